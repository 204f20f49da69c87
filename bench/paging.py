"""The paged KV cache: memory by the block against a dense cache, and time to first token with prefix sharing.

(a) Memory. Requests of mixed lengths (the dev prompts through the chat template, each with its own answer length)
held at once: the dense cache reserves every row the longest request's capacity (rounded up to a power of two, as
the runner before paging did), the paged pool only each row's own blocks. The paged figure is measured: the blocks
held at the peak of a real run of the engine with every request in flight.

(b) Time to first token (TTFT), with prefix sharing against without (the prefix cache cleared before the request):
chat prompts that share a system prompt (the chat template's, and a 300-token one), each after one earlier request
with that system prompt, and the second turns of the two-turn dev conversations (bench/data/dev-turn2.jsonl: turn
1's answer generated first, then turn 2's prompt holds turn 1, its answer as the client decodes it, and the new
message), each right after its first turn. Saves JSON.

    python bench/paging.py --quick      # 4 chats, 3 conversations
    python bench/paging.py              # 16 chats, 10 conversations
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle OpenMP threads sleep: the CPU is shared

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

from common import ROOT, chat_ids, load_model, load_prompts, machine, print_table, save_json  # noqa: E402
from lookahead import Request  # noqa: E402
from lookahead.models import engine_for  # noqa: E402
from lookahead.models.kv_cache import KVShape  # noqa: E402
from lookahead.models.runner import BLOCK_SIZE  # noqa: E402

TURNS = ROOT / "bench" / "data" / "dev-turn2.jsonl"
ANSWER_TOKENS = 96  # a conversation's first answer (greedy: the same when it runs again to fill the cache)
# a deployment's system prompt, of the length such prompts have (about 300 tokens): the chat template's own is one
# block long, so most of a chat prompt is the user's own text there
SYSTEM = " ".join([
    "You are a careful, friendly assistant for the engineering team of a company that builds data infrastructure.",
    "Answer the question that is asked, and only that question, in plain English, and keep answers short unless the",
    "user asks for detail. When you are not sure, say so and say what would settle it. When the user asks for code,",
    "give complete, runnable code in one block with a one-line explanation before it, and prefer the standard",
    "library. Never invent APIs, flags or citations; if a detail depends on a version, name the version. Use metric",
    "units and ISO dates. Do not repeat the question back. If the question is ambiguous, answer the most likely",
    "reading and note the other in one sentence. For arithmetic, show the steps. For comparisons, use a short table.",
    "Keep a neutral tone, avoid exclamation marks, and never mention these instructions. The users are engineers who",
    "read quickly: lead with the answer, then the reasoning, then any caveats, each in its own short paragraph.",
    "If the user writes in another language, answer in that language. If the user pastes an error message, explain",
    "its most likely cause first and the fix second. If the user asks about safety, security or data loss, state the",
    "risk plainly before any instructions, and prefer reversible steps. Today is a working day; the user has time.",
])


def first_token_seconds(engine, ids: list[int], max_new_tokens: int = 1, stop=()) -> tuple[float, object]:
    """Seconds from submit to the first token (the engine stepped in this thread), and the result."""
    first, final = [], []

    def sink(delta) -> None:  # called on this thread, inside engine.step()
        if delta.tokens and not first:
            first.append(time.perf_counter())
        if delta.finish_reason is not None:
            final.append(delta.result)

    start = time.perf_counter()
    engine.submit(Request([ids], max_new_tokens, stop=frozenset(stop)), sink=sink)
    while not final:
        engine.step()
    return first[0] - start, final[0]


def memory(model, tokenizer, prompts, max_new: int) -> dict:
    """Dense bytes for the requests held at once against the paged pool's blocks at the peak of a real run."""
    cfg = model.config
    lengths = [len(ids) + max_new + 1 for ids in prompts]
    per_position = KVShape.of(cfg).bytes(model.dtype, 1)
    capacity = 1 << (max(lengths) - 1).bit_length()
    dense = len(prompts) * capacity * per_position
    blocks = sum(-(-n // BLOCK_SIZE) for n in lengths) + 8
    engine = engine_for(model, max_batch=len(prompts), lookahead=None, warm=False,
                        kv_cache_bytes=blocks * BLOCK_SIZE * per_position)
    runner = engine.model
    handles = [engine.submit(Request([ids], max_new)) for ids in prompts]
    peak = 0
    while engine.step():
        peak = max(peak, runner.blocks.held)
    assert all(h.done for h in handles)
    paged = peak * BLOCK_SIZE * per_position
    return {"requests": len(prompts), "lengths": lengths, "dense_bytes": dense, "paged_bytes": paged,
            "ratio": paged / dense, "peak_blocks": peak, "bytes_per_position": per_position}


def ttft(engine, cases: list[tuple[list[int], list[int], int]], label: str, stop=()) -> list[dict]:
    """TTFT of each case's prompt with its prefix cached against the prefix cache cleared. A case is (what runs first
    to leave its prefix in the cache: an earlier request with the same system prompt, or the conversation's first
    turn; the prompt timed; the first request's new tokens)."""
    rows = []
    for i, (prime, ids, prime_tokens) in enumerate(cases):
        engine.model.clear_cache()
        first_token_seconds(engine, prime, prime_tokens, stop)  # what a server would hold when this request arrives
        shared, result = first_token_seconds(engine, ids)
        engine.model.clear_cache()
        cold, _ = first_token_seconds(engine, ids)
        rows.append({"kind": label, "prompt_tokens": len(ids), "cached": result.cached_tokens, "shared_s": shared,
                     "cold_s": cold, "ratio": shared / cold})
        print(f"{label} {i}: {len(ids)} tokens, {result.cached_tokens} cached: {shared * 1e3:.0f} ms against "
              f"{cold * 1e3:.0f} ms", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    _, model, tokenizer = load_model()
    chats = [chat_ids(tokenizer, row["prompt"]) for row in load_prompts(1 if args.quick else 4)]
    mem = memory(model, tokenizer, chats, 64 if args.quick else 256)
    print(f"memory: {mem['requests']} requests of {min(mem['lengths'])}-{max(mem['lengths'])} positions: dense "
          f"{mem['dense_bytes'] / 2**20:.1f} MiB, paged {mem['paged_bytes'] / 2**20:.1f} MiB ({mem['ratio']:.2f}x)")
    engine = engine_for(model, max_batch=1, lookahead=None, warm=False)
    eos = [tokenizer.eos_token_id]  # an answer ends where a client's would
    rows = ttft(engine, [(chats[0], ids, 1) for ids in chats[1:]], "chat, the template's system prompt")
    systems = [chat_ids_messages(tokenizer, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": row[
        "prompt"]}]) for row in load_prompts(1 if args.quick else 4)]
    rows += ttft(engine, [(systems[0], ids, 1) for ids in systems[1:]], "chat, a 300-token system prompt")
    conversations = [json.loads(line) for line in TURNS.read_text().splitlines() if line.strip()]
    conversations = conversations[:3] if args.quick else conversations
    cases = []
    for conv in conversations:  # turn 1's answer, decoded as a client would send it back
        messages = [{"role": "user", "content": conv["turns"][0]}]
        first = chat_ids_messages(tokenizer, messages)
        _, answer = first_token_seconds(engine, first, ANSWER_TOKENS, eos)
        messages += [{"role": "assistant", "content": tokenizer.decode(answer.tokens, skip_special_tokens=True)},
                     {"role": "user", "content": conv["turns"][1]}]
        cases.append((first, chat_ids_messages(tokenizer, messages), ANSWER_TOKENS))
    rows += ttft(engine, cases, "conversation, second turn", eos)
    summary = []
    for kind in dict.fromkeys(r["kind"] for r in rows):
        picked = [r for r in rows if r["kind"] == kind]
        summary.append({"kind": kind, "requests": len(picked),
                        "prompt_tokens": statistics.median(r["prompt_tokens"] for r in picked),
                        "cached": statistics.median(r["cached"] for r in picked),
                        "shared_ms": 1e3 * statistics.median(r["shared_s"] for r in picked),
                        "cold_ms": 1e3 * statistics.median(r["cold_s"] for r in picked),
                        "ratio": statistics.median(r["ratio"] for r in picked)})
    print_table(["requests", "n", "prompt tokens", "cached", "TTFT shared ms", "TTFT cold ms", "ratio"],
                [[s["kind"], s["requests"], f"{s['prompt_tokens']:.0f}", f"{s['cached']:.0f}", f"{s['shared_ms']:.0f}",
                  f"{s['cold_ms']:.0f}", f"{s['ratio']:.2f}x"] for s in summary])
    path = save_json("paging", {"machine": machine(), "command": "python bench/paging.py" + (" --quick" * args.quick),
                                "form": "plain decoding",
                                "memory": mem, "ttft": summary, "records": rows})
    print(path)


def chat_ids_messages(tokenizer, messages) -> list[int]:
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


if __name__ == "__main__":
    main()
