"""One model shared by threads, and the memory a generation holds: calls take turns instead of corrupting each other,
a KV cache that cannot fit is refused before it is allocated, and `release` frees what generations keep."""

import threading
import weakref

import pytest

import lookahead.models.kv_cache as kv_cache
from lookahead import LookaheadConfig
from lookahead.models import Llama


def test_threads_calling_generate_on_one_model_each_get_their_own_tokens(tiny_checkpoint):
    """Every call shares the model's one runner and cache; without the model's lock one call's reset broke another's
    generation midway (wrong tokens, no error). A batch beside single prompts too."""
    model = Llama.from_pretrained(tiny_checkpoint("gqa"))
    prompts = [[3, 17, 22, 3, 17, 5], [9, 8, 7], [1, 2, 3, 4, 1, 2], [40, 41, 40, 41]]
    cfg = LookaheadConfig(2, 3, 2)
    expected = [model.generate(p, max_new_tokens=30, lookahead=cfg, eos_token_id=[]).tokens for p in prompts]
    expected_batch = [r.tokens for r in model.generate(prompts[:2], max_new_tokens=30, lookahead=cfg,
                                                       eos_token_id=[])]
    got: dict = {}
    start = threading.Barrier(5)

    def one(i):
        start.wait()
        got[i] = model.generate(prompts[i], max_new_tokens=30, lookahead=cfg, eos_token_id=[]).tokens

    def batch():
        start.wait()
        got["batch"] = [r.tokens for r in model.generate(prompts[:2], max_new_tokens=30, lookahead=cfg,
                                                         eos_token_id=[])]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)] + [threading.Thread(target=batch)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert [got[i] for i in range(4)] == expected and got["batch"] == expected_batch


def test_a_kv_cache_that_cannot_fit_is_refused_before_allocating(tiny_checkpoint, monkeypatch):
    model = Llama.from_pretrained(tiny_checkpoint("gqa"))
    model.generate([1, 2, 3], max_new_tokens=4)
    monkeypatch.setattr(kv_cache, "free_bytes", lambda device: 2**20)  # 1 MiB free
    runner = model.runner
    with pytest.raises(ValueError, match=r"the KV cache of 1024 blocks of 16 positions needs 8.01 MiB on "
                                         r"cpu, where 1.00 MiB are free: give fewer prompts"):
        model.generate([[1, 2, 3]] * 1024, max_new_tokens=4)
    monkeypatch.undo()
    assert model.runner is runner and runner.capacity == 256  # nothing left half-built
    assert model.generate([1, 2, 3], max_new_tokens=4).tokens


def test_release_frees_the_cache_generations_keep(tiny_checkpoint):
    model = Llama.from_pretrained(tiny_checkpoint("gqa"))
    model.generate([[1, 2, 3]] * 8, max_new_tokens=4)
    cache = weakref.ref(model.runner.pool)
    model.release()
    assert model.runner is None and cache() is None  # freed at once, no garbage collection needed
    assert model.generate([1, 2, 3], max_new_tokens=4).tokens and not model.runner.rows


def test_warmup_auto_prepares_what_auto_runs(tiny_checkpoint):
    """warmup(lookahead="auto") with static steps prepares every step shape generate(lookahead="auto") can run at
    each batch size, plain steps included."""
    model = Llama.from_pretrained(tiny_checkpoint("gqa"))
    model.warmup("auto", max_tokens=64, batch=2, static_step=True)
    prepared = set(model.runner.step_shapes)
    model.generate([[1, 2, 3, 1, 2, 3], [4, 5]], max_new_tokens=16, lookahead="auto", static_step=True)
    model.generate([1, 2, 3, 1, 2, 3], max_new_tokens=16, lookahead="auto", static_step=True)
    assert set(model.runner.step_shapes) == prepared and {shape.rows for shape in prepared} == {1, 2}
