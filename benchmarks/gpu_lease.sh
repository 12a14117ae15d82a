#!/usr/bin/env bash
# A GPU lease's checks (issue 51) in one call of about 9 minutes, each phase bounded so that the later ones run:
#   1. cohort training against one client at a time on the Fashion-MNIST CNN protocol's synchronous rounds, side
#      by side (benchmarks/cohort.py);
#   2. the CUDA tests: tests/test_gpu.py, tests/test_devices.py and tests/test_cohort.py's CUDA test;
#   3. issue 47's CUDA node: benchmarks/deploy_overhead.py (a local deployment, Flower's executor against the warm
#      one; the node's device is `auto`, so CUDA there);
#   4. a real sweep on the GPU, `--jobs 10` (lanes x cohort), until the call's end: issue 49's diagnosis sweep,
#      whose finished runs come back in tuning.jsonl (append the lines the local file lacks);
#   and, in env.txt, whether this machine can run containers (docker/compose.gpu.yml).
# Here first: `bash benchmarks/gpu_lease.sh prepare` puts the wheels the device image lacks (Flower 1.42 and its
# needs, for its Python 3.12) in .whl/ and Fashion-MNIST's idx files in .gpudata/fashion-mnist/, both kept out of
# git (.git/info/exclude). Then on the device, from the repository root, with both named in the tool's `carry`:
# `bash benchmarks/gpu_lease.sh`. Results go to $OUT (default outputs/gpu-lease), each file as its phase writes it.
set -u
if [ "${1:-}" = prepare ]; then
  set -e
  grep -qx '/.whl/' .git/info/exclude 2>/dev/null || printf '/.whl/\n/.gpudata/\n' >> .git/info/exclude
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
    flwr==1.42.0 cryptography==50.0.2 cffi==2.1.1 pycparser==3.12 pycryptodome==3.24.1 iterators==0.0.2 \
    grpcio-health-checking==1.81.1 tomli==2.5.0 tomli-w protobuf==6.33.6 typer==0.20.1 click==8.5.1 rich==14.3.4 \
    alembic==1.20.1 annotated-types==0.8.0 fastapi==0.138.2 greenlet==3.5.6 Mako==1.4.3 pathspec==1.1.1 \
    prompt_toolkit==3.0.53 pydantic==2.14.4 pydantic_core==2.50.5 python-dotenv==1.2.4 SQLAlchemy==2.1.9 \
    starlette==1.3.1 typing-inspection==0.4.5 uvicorn==0.49.0 wcwidth==0.9.4  # the image has grpcio, httpx, yaml
  mkdir -p .gpudata && cp -r /usr/share/datasets/fashion-mnist .gpudata/  # make data, if it is not there
  du -sh .whl .gpudata
  exit 0
fi
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
      && export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
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
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH

echo "== 1. cohort against one client at a time ($(left) s left)"
# synchronous rounds (FedAvg: all 10 clients of a round in one cohort); the asynchronous protocol (3.4 clients per
# pull) was measured on 2026-11-27: 1.82x (benchmarks/results/gpu-lease/)
timeout 150 python3 -m benchmarks.cohort --preset feddle-fmnist/fedavg-dir0.1-n20 --steps 10 --repeats 2 \
  --out "$OUT/cohort.jsonl" > "$OUT/cohort.log" 2>&1
echo "exit $? after $((SECONDS - START)) s"; grep -h '"kind": "\(ratio\|lanes\)"' "$OUT/cohort.jsonl"

echo "== 2. CUDA tests ($(left) s left)"
timeout 150 python3 -m pytest -q -p no:cacheprovider -rs tests/test_gpu.py tests/test_devices.py \
  tests/test_cohort.py -k "cuda or gpu or devices" > "$OUT/pytest.log" 2>&1
echo "exit $? after $((SECONDS - START)) s"; tail -3 "$OUT/pytest.log"

echo "== 3. deploy overhead on a CUDA node, flower against warm ($(left) s left)"
timeout 200 python3 -m benchmarks.deploy_overhead --rounds 3 --executors warm,flower > "$OUT/deploy_overhead.log" 2>&1
echo "exit $? after $((SECONDS - START)) s"; tail -14 "$OUT/deploy_overhead.log"

echo "== 4. a sweep on the GPU, 10 lanes ($(left) s left)"
RESULTS=benchmarks/results/feddle-fmnist/tuning.jsonl
(while sleep 10; do cp "$RESULTS" "$OUT/tuning.jsonl"; done) &
COPIER=$!
timeout $(( $(left) > 30 ? $(left) - 10 : 20 )) python3 -m hybridfl.cli sweep benchmarks/sweeps/feddle-fmnist-async.yaml \
  --jobs 10 > "$OUT/sweep.log" 2>&1
echo "exit $? after $((SECONDS - START)) s"
kill $COPIER; cp "$RESULTS" "$OUT/tuning.jsonl"; grep -c . "$OUT/tuning.jsonl"; grep '^\[' "$OUT/sweep.log" | tail -20
