"""Compiled decode/verify steps: the same greedy tokens as the eager forward whatever the mix of
small steps; packages built once per set-up and loaded by later starts; a failed compile leaves
the engine eager."""

import logging
import os
import subprocess
import sys
import tempfile

import pytest
import torch

from tidal import SamplingParams
from tidal.config import CacheConfig, SpecConfig
from tidal.engine import model_runner, profile_cache
from tidal.engine.compiled_step import InductorStep, LoadedPackage, PackagedStep
from tidal.engine.llm_engine import LLM
from tests.test_spec import REPEAT, repetitive_prompts

NGRAM = SpecConfig(method="ngram", num_speculative_tokens=3, mode="fixed")


def tiny(path, **kw) -> LLM:
    return LLM(str(path), dtype="float32", cache=CacheConfig(block_size=4, num_blocks=512), spec=NGRAM, **kw)


@pytest.fixture(scope="module")
def compiled(tiny_model_dir):
    return tiny(tiny_model_dir, wait_compiled=False)


def frames() -> int:
    from torch._dynamo.utils import counters

    return sum(counters["frames"].values()) if "frames" in counters else 0


def assert_matches_eager(tiny_model_dir, llm: LLM) -> None:
    """Plain decode at 1..17 requests and n-gram verification (drafts of 1..3 tokens beside plain
    decoding, padded in one group): steps of every graph, 64 tokens (16 requests verifying 3
    drafts) and past it (eager)."""
    eager = tiny(tiny_model_dir, enforce_eager=True)
    prompts = repetitive_prompts(17)
    for n in (1, 2, 6, 16, 17):
        want = eager.generate(prompts[:n], [REPEAT] * n)
        got = llm.generate(prompts[:n], [REPEAT] * n)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]


def test_a_first_start_serves_while_the_larger_steps_compile(tiny_model_dir, compiled):
    runner = compiled.engine.runner  # the module's first start: this test session's cache is empty
    assert not runner.compiled.graphs and set(runner.compiling) == {"one", "few", "many", "wide"}
    assert {PackagedStep.MAX_TOKENS, PackagedStep.MAX_TOKENS + 1} <= set(compiled.engine.step_cost.knots)
    assert_matches_eager(tiny_model_dir, compiled)  # their steps eager until the packages land
    assert runner.land_compiled(wait=True)
    assert set(runner.compiled.graphs) == {"one", "few", "many", "wide"} and not runner.compiling
    assert_matches_eager(tiny_model_dir, compiled)


def test_packaged_steps_match_eager_greedy_on_the_tiny_model(tiny_model_dir, compiled, monkeypatch):
    compiled.engine.runner.land_compiled(wait=True)
    step = compiled.engine.runner.compiled
    assert isinstance(step, PackagedStep)
    calls = {g: 0 for g in step.graphs}
    for g, run in list(step.graphs.items()):
        monkeypatch.setitem(step.graphs, g, lambda *a, g=g, run=run: (calls.__setitem__(g, calls[g] + 1), run(*a))[1])
    assert_matches_eager(tiny_model_dir, compiled)
    assert all(calls.values()) and len(calls) == 4


def test_a_package_loads_in_place_writing_nothing_to_the_temp_folder(compiled, monkeypatch, tmp_path):
    """torch's archive loader unpacked a package (weights included) under TMPDIR on every start
    and deleted the copy only in the model's destructor, which a killed server never runs; a
    package is now the library alone, loaded where it lies."""
    runner = compiled.engine.runner
    runner.land_compiled(wait=True)
    prompt = repetitive_prompts(1)
    want = compiled.generate(prompt, [REPEAT])[0].token_ids
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)  # read TMPDIR again
    graph = LoadedPackage(profile_cache.cache_dir() / "compiled" / f"step-{runner.compiled_key}-one.so",
                          runner.compiled.tensors)
    assert list(tmp_path.iterdir()) == []
    calls = []
    monkeypatch.setitem(runner.compiled.graphs, "one", lambda *a: (calls.append(1), graph(*a))[1])
    assert compiled.generate(prompt, [REPEAT])[0].token_ids == want and calls


def test_a_start_from_cached_packages_imports_neither_inductor_nor_dynamo(tiny_model_dir, compiled):
    """Their imports are over a second of a start, and loading a package needs neither."""
    compiled.engine.runner.land_compiled(wait=True)
    code = ("import sys; from tidal import LLM; from tidal.config import CacheConfig, SpecConfig; "
            "llm = LLM(sys.argv[1], dtype='float32', cache=CacheConfig(block_size=4, num_blocks=512), "
            "spec=SpecConfig(method='ngram', num_speculative_tokens=3, mode='fixed')); "
            "print(sorted(llm.engine.runner.compiled.graphs), [m for m in ('torch._inductor', 'torch._dynamo') "
            "if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code, str(tiny_model_dir)], capture_output=True, text=True, check=True,
                         env={**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())})  # the same set-up
    assert out.stdout.splitlines()[-1] == "['few', 'many', 'one', 'wide'] []"


def test_a_second_start_loads_the_packages_and_other_threads_compile_anew(tiny_model_dir, compiled, monkeypatch):
    jobs = []
    run = model_runner._run_workers
    monkeypatch.setattr(model_runner, "_run_workers", lambda batches: (jobs.extend(batches), run(batches))[1])
    # waits on the set-up's lock while the first start's workers still compile, then loads all
    assert set(tiny(tiny_model_dir).engine.runner.compiled.graphs) == {"one", "few", "many", "wide"}
    assert jobs == []
    threads = torch.get_num_threads()
    record = lambda batches, *_, **__: (jobs.extend(j for b in batches for j in b), [])[1]  # noqa: E731
    monkeypatch.setattr(model_runner, "_run_workers", record)  # records, builds nothing
    monkeypatch.setattr(model_runner, "_start_workers", record)
    torch.set_num_threads(threads + 1)
    try:
        tiny(tiny_model_dir)
    finally:
        torch.set_num_threads(threads)
    assert sorted(j["graph"] for j in jobs) == ["few", "many", "one", "wide"] and {j["threads"] for j in jobs} == {threads + 1}


def test_a_start_in_the_background_serves_eager_while_another_process_compiles(tiny_model_dir, compiled, caplog):
    """A start that finds another process compiling its set-up (a short `tidal generate` leaves
    its worker behind) does not wait minutes for it: it serves eager and lands each package as
    that process writes it."""
    runner = compiled.engine.runner
    runner.land_compiled(wait=True)
    directory = profile_cache.cache_dir() / "compiled"
    package = directory / f"step-{runner.compiled_key}-one.so"
    aside = package.with_name("aside.so")
    package.rename(aside)
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, sys, time; f = open(sys.argv[1], 'a'); "
                               "fcntl.flock(f, fcntl.LOCK_EX); print(flush=True); time.sleep(120)",
                               str(directory / f"step-{runner.compiled_key}.lock")], stdout=subprocess.PIPE, text=True)
    try:
        holder.stdout.readline()  # the lock is held
        with caplog.at_level(logging.INFO, logger="tidal.engine"):
            llm = tiny(tiny_model_dir, wait_compiled=False)
        second = llm.engine.runner
        assert set(second.compiling) == {"one"} and set(second.compiled.graphs) == {"few", "many", "wide"}
        assert "another process is compiling one" in caplog.text
        assert_matches_eager(tiny_model_dir, llm)
        assert not second.land_compiled() and second.compiling  # still held, the package not written
        aside.rename(package)
        holder.kill()
        holder.wait()
        assert second.land_compiled() and set(second.compiled.graphs) == {"one", "few", "many", "wide"}
        assert_matches_eager(tiny_model_dir, llm)
    finally:
        holder.kill()
        if aside.exists():
            aside.rename(package)


def test_packages_of_set_ups_unused_for_a_week_are_pruned(tmp_path):
    now = 1_000_000_000.0
    for key, age_days in (("old", 8), ("recent", 6)):
        for name in (f"step-{key}.lock", f"step-{key}-one.so", f"step-{key}-many.so", f"step-{key}-few.pt2"):
            (tmp_path / name).write_bytes(b"x")
        os.utime(tmp_path / f"step-{key}.lock", (now - age_days * 86400,) * 2)
        for partial in (f".step-{key}-wide.123.pt2", f".step-{key}-wide.123.so"):  # a killed worker's
            (tmp_path / partial).write_bytes(b"x")
            os.utime(tmp_path / partial, (now - age_days * 86400,) * 2)
    assert model_runner.prune_packages(tmp_path, now - model_runner.PACKAGE_MAX_IDLE_S) == ["old"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".step-recent-wide.123.pt2", ".step-recent-wide.123.so",
                                                          "step-recent-few.pt2", "step-recent-many.so",
                                                          "step-recent-one.so", "step-recent.lock"]


def test_compiling_a_package_leaves_no_copy_of_its_library_in_inductors_cache(tiny_model_dir, monkeypatch, tmp_path):
    """Inductor keeps each library it builds (weights and all) in its cache (under the temp folder
    by default), where nothing deletes it; once the package holds it, that copy goes (the kernels
    stay)."""
    cache = tmp_path / "inductor"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))  # the worker's
    package = tmp_path / "step-one.so"
    model_runner._run_workers([[{"model": str(tiny_model_dir), "dtype": "float32", "device": "cpu",
                                "threads": torch.get_num_threads(), "aux_layers": [], "block_size": 4,
                                "qblock": [], "graph": "one", "path": str(package)}]])
    # no archive, no partial file; beside the library, its weights (dense: its own copy, prepacked)
    # and the spec by which it calls tidal's operators
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == [
        package.with_suffix(".blob").name, package.with_suffix(".json").name, package.name]
    package.with_suffix(".blob").unlink()  # a cache half deleted: a clear error, not a crash
    with pytest.raises(FileNotFoundError, match="constants"):
        LoadedPackage(package, {})
    cached = [p.name for p in cache.rglob("*") if p.is_file()]
    assert any(name.endswith(".kernel.cpp") for name in cached)  # the compile did use that cache
    assert not [name for name in cached if ".wrapper." in name]  # the library, its source, its metadata


def test_a_failed_compile_leaves_the_engine_eager(tiny_model_dir, monkeypatch, caplog):
    def fail(jobs):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(model_runner, "_run_workers", fail)
    monkeypatch.setattr(model_runner, "_source_digest", lambda: "another")  # nothing cached under this key
    with caplog.at_level(logging.WARNING, logger="tidal.engine"):
        llm = tiny(tiny_model_dir)
    assert llm.engine.runner.compiled is None and "no C++ compiler" in caplog.text
    assert len(llm.generate(["hello"], SamplingParams(max_tokens=4))[0].token_ids) == 4


def test_inductor_steps_match_eager_and_never_recompile(tiny_model_dir, monkeypatch):
    """The CUDA mechanism (torch.compile, the graphs it covers captured at start-up), run on the CPU."""
    monkeypatch.setattr(model_runner, "PACKAGED_DEVICES", ())
    llm = tiny(tiny_model_dir)
    assert isinstance(llm.engine.runner.compiled, InductorStep)
    assert {InductorStep.MAX_TOKENS, InductorStep.MAX_TOKENS + 1} <= set(llm.engine.step_cost.knots)
    after_warm_up = frames()
    assert after_warm_up >= 2  # one token, and the dynamic graph of more
    assert_matches_eager(tiny_model_dir, llm)
    assert frames() == after_warm_up


@pytest.mark.slow
def test_compiled_steps_match_eager_greedy_on_the_bundled_model():
    eager, compiled = LLM(dtype="float32", enforce_eager=True), LLM(dtype="float32")
    assert compiled.engine.runner.compiled is not None
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    prompts = ["The capital of France is", "Write a haiku about the sea.", "1, 2, 3, 4,"] * 6
    for n in (1, 3, 18):  # 18: steps of the 9-64 token graph
        assert ([o.token_ids for o in compiled.generate(prompts[:n], params)]
                == [o.token_ids for o in eager.generate(prompts[:n], params)])


def test_a_compiled_step_lays_long_query_runs_out_in_rows_of_the_cheapest_width(compiled):
    assert model_runner.query_width([1] * 32) == 2  # export specialises 1: decodes get a padding query
    assert model_runner.query_width([5] + [1] * 31) == 2  # 34 rows of 2, not 32 padded to 5
    assert model_runner.query_width([5] * 12) == 5
    assert model_runner.query_width([24] + [1] * 30) == 3  # a prompt's chunk beside decodes
    from tidal.sequence import Sequence

    seq, other = (Sequence(name, list(range(1, 9)), SamplingParams()) for name in ("a", "b"))
    seq.block_table, other.block_table = [0, 1], [2, 3]
    runner = compiled.engine.runner
    _, meta = runner.metadata([(seq, 3, 5)] + [(other, 7, 1)] * 9, compiled=True)  # 5 queries at 3..7; decodes at 7
    (g,) = meta.groups
    assert g.token_index.tolist() == [[0, 1], [2, 3], [4, 0]] + [[5 + i, 0] for i in range(9)]
    assert g.mask[:3, 0].sum(-1).tolist() == [[4, 5], [6, 7], [8, 1]]  # keys each query sees (padding: one)
    assert g.kv_slots[1, :7].tolist() == list(range(7)) and g.kv_slots[3, :8].tolist() == list(range(8, 16))
    assert g.out_index.tolist() == list(range(14)) and g.rows.tolist() == [0, 1, 2, 3, 4, *range(6, 24, 2)]


def test_a_prompt_beside_decoding_requests_runs_compiled_and_matches_eager(tiny_model_dir, compiled, monkeypatch):
    compiled.engine.runner.land_compiled(wait=True)
    runner = compiled.engine.runner
    fed_compiled = []
    metadata = runner.metadata
    monkeypatch.setattr(runner, "metadata", lambda spans, compiled=False: (
        compiled and fed_compiled.append({(s.request_id, start, n) for s, start, n in spans}), metadata(spans, compiled))[1])
    prompts = repetitive_prompts(5)

    def run(llm) -> dict[str, list[int]]:
        engine, done = llm.engine, {}
        for i in range(4):
            engine.add_request(f"early-{i}", prompts[i], REPEAT)
        while len(done) < 5:
            if len(done) == 0 and engine.scheduler.running and all(s.output_token_ids for s in engine.scheduler.running):
                if "late" not in {s.request_id for s in engine.scheduler.running + engine.scheduler.waiting}:
                    engine.add_request("late", prompts[4], REPEAT)  # its prompt beside four decoding requests
            done.update((o.request_id, o.token_ids) for o in engine.step() if o.finished)
        return done

    assert run(compiled) == run(tiny(tiny_model_dir, enforce_eager=True))
    assert any(("late", 0, len(prompts[4])) in step and any(n == 1 for _, _, n in step) for step in fed_compiled)
