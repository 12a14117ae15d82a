#!/usr/bin/env bash
# A GPU lease's checks (issue 60) in one call of under 8 minutes, each phase bounded so that the later ones run:
#   1. the CUDA tests: tests/test_gpu.py, tests/test_devices.py and tests/test_cohort.py's CUDA tests (full FP32
#      for the cohort's comparison: the TF32 pin);
#   2. the in-flight cohort against one client at a time on the Fashion-MNIST CNN's asynchronous protocol (FedBuff,
#      Dir(0.1)/N(20)), side by side: one run's updates/s (benchmarks/cohort_speed.py);
#   3. a sweep's runs per hour at 1, 4, 8 and 16 lanes sharing the GPU (benchmarks/lanes.py: --jobs N, each lane a
#      process with its cohort, each lane count in a 45 s box), and on a one-node Ray cluster with fractional GPUs
#      where the machine has Ray; GPU memory per lane;
#   and, in env.txt, the GPU, torch, Flower and whether the machine can run containers.
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
BUDGET=${BUDGET:-450}  # seconds for the whole script
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

echo "== 1. CUDA tests ($(left) s left)"
timeout 120 python3 -m pytest -q -p no:cacheprovider -rs tests/test_gpu.py tests/test_devices.py \
  tests/test_cohort.py -k "cuda or gpu or devices" > "$OUT/pytest.log" 2>&1
echo "exit $? after $((SECONDS - START)) s"; tail -3 "$OUT/pytest.log"

echo "== 2. the in-flight cohort against one client at a time ($(left) s left)"
timeout 150 python3 -m benchmarks.cohort_speed --preset feddle-fmnist/fedbuff-dir0.1-n20 --steps 10 --repeats 2 \
  --out "$OUT/cohort.jsonl" > "$OUT/cohort.log" 2>&1
echo "exit $? after $((SECONDS - START)) s"; grep -h '"kind": "ratio"' "$OUT/cohort.jsonl"

echo "== 3. a sweep's lanes sharing the GPU ($(left) s left)"
RAY=$(python3 -c "import ray" 2>/dev/null && echo "--ray-lanes 8")
timeout $(( $(left) > 60 ? $(left) - 10 : 50 )) python3 -m benchmarks.lanes --lanes 1,4,8,16 $RAY --seconds 45 \
  --rounds 10 --out "$OUT/lanes.jsonl" > "$OUT/lanes.log" 2>&1
echo "exit $? after $((SECONDS - START)) s ${RAY:-(no Ray on this machine: --ray not measured)}"
cat "$OUT/lanes.jsonl"
