#!/usr/bin/env bash
# tidal on a CUDA machine, in at most about 5 minutes: the engine tests on cuda, the compiled
# step (torch.compile with CUDA graphs) against eager, and a short adaptive sweep.
#
#     bash benchmarks/gpu_check.sh [OUT_DIR]
#
# Needs the project installed (pip install -e ".[dev]") with a CUDA build of torch. Each part has
# its own time limit; the script goes on after a failure and exits non-zero if any part failed.
# The sweep's records go to OUT_DIR (default bench-results/gpu-check).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-bench-results/gpu-check}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1

if ! python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: torch sees no CUDA device; nothing to check here" >&2
    exit 2
fi
python -c "import torch; print('gpu_check:', torch.__version__, torch.cuda.get_device_name(0))"
failed=0
part() {  # part NAME SECONDS COMMAND...
    local name=$1 limit=$2
    shift 2
    echo "== $name (at most ${limit} s)"
    local start=$SECONDS
    timeout "$limit" "$@"
    local rc=$?
    echo "== $name: exit $rc after $((SECONDS - start)) s"
    [ "$rc" -eq 0 ] || failed=1
}

# the engine tests, whose engines pick cuda on their own (device "auto")
part "engine tests on cuda" 120 python -m pytest -q -x -p no:cacheprovider \
    tests/test_engine_tiny.py tests/test_spec.py tests/test_eagle.py tests/test_llama_vs_hf.py

# compiled steps: CUDA graphs captured at start-up, greedy equal to eager, no recompiles, step times
part "compiled step (CUDA graphs)" 90 python - <<'EOF'
import statistics, time

import torch
from torch._dynamo.utils import counters

from tidal import LLM, SamplingParams
from tidal.engine.compiled_step import InductorStep

params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
prompts = ["The capital of France is", "Write a haiku about the sea.", "1, 2, 3, 4,"]
eager, compiled = LLM(dtype="float32", enforce_eager=True), LLM(dtype="float32")
assert isinstance(compiled.engine.runner.compiled, InductorStep), "compiled steps did not start"
frames = sum(counters["frames"].values())
for n in (1, 3):
    want = [o.token_ids for o in eager.generate(prompts[:n], params)]
    got = [o.token_ids for o in compiled.generate(prompts[:n], params)]
    assert got == want, f"compiled greedy differs from eager at {n} requests"
assert sum(counters["frames"].values()) == frames, "a step recompiled while serving"
print("compiled greedy == eager (float32, 1 and 3 requests), no recompiles")

for name, llm in (("eager", LLM(enforce_eager=True)), ("compiled", LLM())):
    eng = llm.engine
    for c in (1, 8):
        for i in range(c):
            eng.add_request(f"{name}-{c}-{i}", [1, 2, 3, 4 + i], SamplingParams(max_tokens=200, ignore_eos=True))
        for _ in range(20):
            eng.step()
        times = []
        for _ in range(100):
            torch.cuda.synchronize()
            t = time.perf_counter()
            eng.step()
            times.append(time.perf_counter() - t)
        for i in range(c):
            eng.abort(f"{name}-{c}-{i}")
        print(f"{name} step at {c} requests: {1e3 * statistics.median(times):.2f} ms (median of 100)")
EOF

# a short adaptive sweep: off, fixed K and adaptive, interleaved (benchmarks/adaptive.py)
part "adaptive sweep" 120 python benchmarks/adaptive.py --concurrency 1,8,32 --output-len 64 \
    --modes off,fixed:2,adaptive:4 --json "$out/adaptive.json"

exit $failed
