"""The server app in-process over a scripted fake engine: the paths a real model can't be made to
take on demand (engine failure, the shutdown drain, chosen-K from the engine's step stats)."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from tidal.engine.llm_engine import EngineLoad, RequestOutput  # noqa: E402
from tidal.sampling_params import InvalidParameter  # noqa: E402
from tidal.sequence import Sequence, SequenceStatus  # noqa: E402
from tidal.server import build_app  # noqa: E402
from tidal.server.metrics import chosen_ks  # noqa: E402

MODEL = "fake"


class FakeTokenizer:
    def encode(self, text: str) -> list[int]:
        return [1 + ord(c) % 100 for c in text]

    def apply_chat_template(self, conversation: list[dict]) -> str:
        return "".join(f"<{m['role']}>{m['content']}" for m in conversation) + "<assistant>"


class FakeEngine:
    """Each step gives every request the letter 'x' and a 2-token draft verified with 1 accepted;
    `fail` makes step() raise; `with_stats` publishes last_step_stats with chosen_k."""

    def __init__(self, with_stats: bool = True, step_s: float = 0.002):
        self.tokenizer = FakeTokenizer()
        self.max_context_len = 4096
        self.seqs: dict[str, Sequence] = {}
        self.fail, self.with_stats, self.step_s = False, with_stats, step_s
        self.last_step_stats = None

    def add_request(self, rid, ids, params):
        if len(ids) + params.max_tokens > 4096:
            raise InvalidParameter("max_tokens", "too large")
        seq = self.seqs[rid] = Sequence(rid, list(ids), params)
        return seq

    def abort(self, rid) -> RequestOutput | None:
        seq = self.seqs.pop(rid, None)
        if seq is None:
            return None
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
        return self._output(seq)

    def has_unfinished(self) -> bool:
        return bool(self.seqs)

    def load(self) -> EngineLoad:
        return EngineLoad(len(self.seqs), 0, len(self.seqs) / 100)

    @staticmethod
    def _output(seq, drafted=0, accepted=0) -> RequestOutput:
        return RequestOutput(seq.request_id, seq.prompt_token_ids, list(seq.output_token_ids), seq.output_text,
                             seq.is_finished, seq.finish_reason, drafted, accepted)

    def step(self):
        if self.fail:
            raise RuntimeError("boom")
        time.sleep(self.step_s)
        outs = []
        for rid, seq in list(self.seqs.items()):
            seq.output_token_ids.append(7)
            seq.output_text += "x"
            if len(seq.output_token_ids) >= seq.params.max_tokens:
                del self.seqs[rid]
                seq.status, seq.finish_reason = SequenceStatus.FINISHED, "length"
            outs.append(self._output(seq, 2, 1))
        if self.with_stats:
            self.last_step_stats = SimpleNamespace(chosen_k=[2] * len(outs))
        return outs


def _app(engine, **kw):
    return TestClient(build_app(engine, model_name=MODEL, **kw))


def _metric(client, line_prefix: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(line_prefix):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{line_prefix} not in /metrics")


def test_tokens_usage_spec_and_chosen_k_metrics():
    with _app(FakeEngine()) as client:
        r = client.post("/v1/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": 5})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0] == {"index": 0, "text": "xxxxx", "logprobs": None, "finish_reason": "length"}
        assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 10}
        assert _metric(client, "tidal:generation_tokens_total") == 5
        assert _metric(client, "tidal:prompt_tokens_total") == 5
        assert _metric(client, "tidal:spec_decode_num_drafted_tokens_total") == 10
        assert _metric(client, "tidal:spec_decode_num_accepted_tokens_total") == 5
        assert _metric(client, 'tidal:spec_decode_num_accepted_tokens_per_pos_total{model_name="fake",position="0"}') == 5
        assert _metric(client, 'tidal:spec_decode_num_drafted_tokens_per_pos_total{model_name="fake",position="1"}') == 5
        assert _metric(client, "tidal:spec_decode_chosen_k_count") == 5  # one K per request per step
        assert _metric(client, "tidal:spec_decode_chosen_k_sum") == 10
        # per request: half its drafts accepted (class mid), two drafts per step it emitted in
        assert _metric(client, "tidal:spec_decode_request_acceptance_rate_count") == 1
        assert _metric(client, "tidal:spec_decode_request_acceptance_rate_sum") == 0.5
        assert _metric(client, 'tidal:spec_decode_request_mean_k_sum{acceptance="mid",model_name="fake"}') == 2.0
        assert _metric(client, "tidal:kv_cache_usage_perc") == 0


def test_no_step_stats_means_no_chosen_k():
    with _app(FakeEngine(with_stats=False)) as client:
        assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3}).status_code == 200
        assert _metric(client, "tidal:spec_decode_chosen_k_count") == 0


@pytest.mark.parametrize("stats, want", [
    (None, []),
    (SimpleNamespace(), []),
    (SimpleNamespace(chosen_k=[0, 3, 1]), [0, 3, 1]),
    ({"chosen_k": {"a": 2, "b": 4}}, [2, 4]),
    (SimpleNamespace(chosen_k="oops"), []),
    (SimpleNamespace(chosen_k=7), []),
    (SimpleNamespace(chosen_k=[1, None, -1, True, 2.0]), [1, 2]),
])
def test_chosen_ks_reads_whatever_the_engine_exposes(stats, want):
    assert chosen_ks(stats) == want


def test_engine_failure_fails_requests_and_health():
    engine = FakeEngine(step_s=0.05)
    with _app(engine) as client:
        with client.stream("POST", "/v1/completions", json={"prompt": "hi", "max_tokens": 1000, "stream": True}) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: {")
            engine.fail = True
            rest = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
        assert "engine failed" in rest[-1]["error"]["message"]
        assert client.get("/health").status_code == 503
        r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "unavailable"


def test_drain_aborts_at_the_deadline_and_refuses_new_requests():
    engine = FakeEngine(step_s=0.01)
    app = build_app(engine, model_name=MODEL)
    with TestClient(app) as client:
        with client.stream("POST", "/v1/completions", json={"prompt": "hi", "max_tokens": 10**3, "stream": True}) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: {")
            app.state.engine.drain(0.3)
            t0 = time.monotonic()
            r2 = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert r2.status_code == 503 and "shutting down" in r2.json()["error"]["message"]
            events = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
            assert events[-1]["choices"][0]["finish_reason"] == "abort"
            assert 0.2 < time.monotonic() - t0 < 5
        assert not engine.seqs and engine.load().running == 0


def test_api_key_and_bad_input_shapes():
    with _app(FakeEngine(), api_key="k") as client:
        assert client.get("/v1/models").status_code == 401
        assert client.get("/v1/models", headers={"Authorization": "Bearer k"}).json()["data"][0]["id"] == MODEL
        r = client.post("/v1/completions", headers={"Authorization": "Bearer k"},
                        json={"prompt": "hi", "max_tokens": True})  # no bool-as-int coercion
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
        r = client.post("/v1/completions", headers={"Authorization": "Bearer k"},
                        json={"prompt": "hi", "max_tokens": 4095})  # the engine's own refusal
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_serve_rejects_bad_options_before_loading(capsys):
    from tidal.cli import main

    assert main(["serve", "--max-waiting", "0"]) == 2
    assert "--max-waiting" in capsys.readouterr().err


def test_engine_built_and_stepped_on_one_compute_thread():
    """`tidal serve` builds the engine on its compute thread; the app steps it on that thread."""
    import threading

    from tidal.server.async_engine import ComputeThread

    compute = ComputeThread()
    built_on = threading.get_ident()

    class Recording(FakeEngine):
        def __init__(self):
            nonlocal built_on
            built_on = threading.get_ident()
            super().__init__()
            self.stepped_on = set()

        def step(self):
            self.stepped_on.add(threading.get_ident())
            return super().step()

    engine = compute.submit(Recording).result()
    with TestClient(build_app(engine, model_name=MODEL, compute=compute)) as client:
        r = client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 3})
        assert r.status_code == 200, r.text
    assert built_on == compute.thread.ident != threading.get_ident()
    assert engine.stepped_on == {compute.thread.ident}
    with pytest.raises(ValueError, match="bad"):  # a job's exception reaches whoever waits on it
        compute.submit(int, "bad").result()
