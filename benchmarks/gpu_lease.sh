#!/usr/bin/env bash
# A GPU lease's checks (issue 51) in one call of about 9 minutes, each phase bounded so that the later ones run:
#   1. cohort training against one client at a time on the Fashion-MNIST CNN protocol, side by side
#      (benchmarks/cohort.py), and 8 lanes of the cohort job at once;
#   2. the CUDA tests: tests/test_gpu.py, tests/test_devices.py and tests/test_cohort.py's CUDA test;
#   3. a real sweep on the GPU, `--jobs 10` (lanes x cohort), until the call's end: issue 49's diagnosis sweep,
#      whose finished runs come back in tuning.jsonl (append the lines the local file lacks);
#   4. whether this machine can run containers (docker/compose.gpu.yml).
# Run from the repository root with the wheels in .whl/ and Fashion-MNIST's idx files in .gpudata/fashion-mnist/
# (both ignored, named in the device tool's `carry`): `bash benchmarks/gpu_lease.sh`. Results go to $OUT (default
# outputs/gpu-lease), each file as soon as its phase writes it.
set -u
START=$SECONDS
BUDGET=${BUDGET:-540}  # seconds for the whole script
OUT=${OUT:-outputs/gpu-lease}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1
export FLWR_HOME=$PWD/.flwr
left() { echo $((BUDGET - (SECONDS - START))); }

{
  echo "== setup $(date -u +%FT%TZ)"
  if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      && export PYTHONPATH=/tmp/site:$PWD
  fi
  export PYTHONPATH=${PYTHONPATH:-$PWD}
  if [ -d .gpudata/fashion-mnist ]; then mkdir -p /usr/share/datasets && cp -r .gpudata/fashion-mnist /usr/share/datasets/; fi
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, flwr; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'flwr', flwr.__version__)"
  # MPS lets the lanes' small kernels run side by side; stopped again if CUDA does not start under it
  if nvidia-cuda-mps-control -d 2>/dev/null; then
    python3 -c "import torch; torch.zeros(1, device='cuda')" || { echo quit | nvidia-cuda-mps-control; echo "MPS off"; }
  fi
  echo "== containers"
  for tool in docker dockerd nvidia-container-toolkit nvidia-ctk; do command -v $tool || echo "no $tool"; done
  echo "setup took $((SECONDS - START)) s"
} > "$OUT/env.txt" 2>&1
export PYTHONPATH=${PYTHONPATH:-$PWD}
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site:$PWD

echo "== 1. cohort against one client at a time ($(left) s left)"
timeout 200 python3 -m benchmarks.cohort --steps 20 --repeats 2 --processes 8 --out "$OUT/cohort.jsonl" \
  > "$OUT/cohort.log" 2>&1
echo "exit $? after $((SECONDS - START)) s"; grep -h '"kind": "\(ratio\|lanes\)"' "$OUT/cohort.jsonl"

echo "== 2. CUDA tests ($(left) s left)"
timeout 150 python3 -m pytest -q -p no:cacheprovider -rs tests/test_gpu.py tests/test_devices.py \
  tests/test_cohort.py -k "cuda or gpu or devices" > "$OUT/pytest.log" 2>&1
echo "exit $? after $((SECONDS - START)) s"; tail -3 "$OUT/pytest.log"

echo "== 3. a sweep on the GPU, 10 lanes ($(left) s left)"
RESULTS=benchmarks/results/feddle-fmnist/tuning.jsonl
(while sleep 10; do cp "$RESULTS" "$OUT/tuning.jsonl"; done) &
COPIER=$!
timeout $(( $(left) > 30 ? $(left) - 10 : 20 )) python3 -m scripts.cli sweep benchmarks/sweeps/feddle-fmnist-async.yaml \
  --jobs 10 > "$OUT/sweep.log" 2>&1
echo "exit $? after $((SECONDS - START)) s"
kill $COPIER; cp "$RESULTS" "$OUT/tuning.jsonl"; grep -c . "$OUT/tuning.jsonl"; grep '^\[' "$OUT/sweep.log" | tail -20
