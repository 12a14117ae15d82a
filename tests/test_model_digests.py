"""tools.model_digests: what shows a restructuring changed no result."""

from __future__ import annotations

import json

from tools.model_digests import compare, digests, main


def test_a_presets_digest_is_its_model_and_a_missing_dataset_is_recorded_as_skipped():
    got = digests(["fedavg-digits", "mixing-celeba/example"], rounds=1)
    assert len(got["fedavg-digits"]) == 64 and int(got["fedavg-digits"], 16) >= 0
    assert got["mixing-celeba/example"].startswith("skipped: ")
    assert digests(["fedavg-digits"], rounds=1) == {"fedavg-digits": got["fedavg-digits"]}  # the seed fixes it
    assert digests(["fedavg-digits"], rounds=2)["fedavg-digits"] != got["fedavg-digits"]


def test_compare_names_every_preset_that_differs_or_is_missing_and_fails(tmp_path, capsys):
    before = {"a": "1" * 64, "b": "2" * 64, "c": "skipped: no data"}
    (tmp_path / "before.json").write_text(json.dumps(before))
    (tmp_path / "same.json").write_text(json.dumps(before))
    (tmp_path / "after.json").write_text(json.dumps({"a": "1" * 64, "b": "3" * 64}))
    assert compare(before, {"a": "1" * 64, "b": "3" * 64}) == ["b", "c"]
    assert main(["--compare", str(tmp_path / "before.json"), str(tmp_path / "same.json")]) == 0
    assert "3 presets alike (2 with the same model.pt" in capsys.readouterr().out
    assert main(["--compare", str(tmp_path / "before.json"), str(tmp_path / "after.json")]) == 1
    assert capsys.readouterr().out.endswith("2 differ\n  b\n  c\n")
