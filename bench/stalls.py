"""Long prompts beside a stream: does a stream stall while a long prompt prefills next to it?

`lookahead serve` (the default model, its default settings) on a free port of 127.0.0.1. A first request streams
(greedy, `ignore_eos`); once it has given `--lead` tokens a second request arrives with a long prompt (dev.jsonl's
prompts joined until the tokenizer counts `--prompt-tokens`), streamed too. The first stream's gaps between chunks are
recorded from its second chunk until the long prompt's answer ends. Reports per prompt length: the long prompt's time
to first token and prefill rate, and the first stream's median and largest gap and their ratio (the goal: at most 3),
when the largest came (seconds after the long prompt) and the ten largest.
Then the long prompt alone (no stream beside it), its time to first token: what the chunking costs it.

    python bench/stalls.py --quick                   # 2,048 tokens only
    python bench/stalls.py                           # 512, 2,048 and 6,144 tokens
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # ours, as README sets it; no peer runs here

import argparse  # noqa: E402
import asyncio  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

from serve import start_server, stop_server  # noqa: E402

from common import long_prompt, machine, print_table, save_json  # noqa: E402


async def stream(client, model: str, content: str, max_tokens: int, times: list[float], done: asyncio.Event | None):
    """Stream one greedy answer, appending each chunk's arrival time to `times`; stop early once `done` is set."""
    response = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": content}], max_tokens=max_tokens, temperature=0,
        stream=True, extra_body={"ignore_eos": True})
    async for chunk in response:
        if chunk.choices and chunk.choices[0].delta.content:
            times.append(time.perf_counter())
        if done is not None and done.is_set():
            await response.close()
            return


async def beside(url: str, text: str, lead: int) -> dict:
    """The long prompt `text` sent once a first stream has given `lead` chunks; both streams' timings."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="none", timeout=900, max_retries=0)
    model = (await client.models.list()).data[0].id
    first, second, done = [], [], asyncio.Event()
    streaming = asyncio.create_task(stream(client, model, "Tell me a long story about a lighthouse.", 8000, first,
                                           done))
    while len(first) < lead:
        if streaming.done():
            await streaming  # it ended early: say why
            raise RuntimeError(f"the first stream ended after {len(first)} chunks, before the long prompt came")
        await asyncio.sleep(0.01)
    sent = time.perf_counter()
    await stream(client, model, text, 8, second, None)
    done.set()
    await streaming
    await client.close()
    gaps = [(b - a, b - sent) for a, b in zip(first[1:], first[2:], strict=False) if b <= second[-1]]
    largest, at = max(gaps)
    return {"ttft": second[0] - sent, "median_gap": statistics.median(gap for gap, _ in gaps), "max_gap": largest,
            "max_gap_at": at, "gaps": len(gaps), "largest_gaps": sorted(round(gap, 4) for gap, _ in gaps)[-10:]}


async def alone(url: str, text: str) -> float:
    """The long prompt's time to first token with nothing beside it."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="none", timeout=900, max_retries=0)
    model = (await client.models.list()).data[0].id
    times = []
    sent = time.perf_counter()
    await stream(client, model, text, 2, times, None)
    await client.close()
    return times[0] - sent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-tokens", type=int, nargs="+", default=[512, 2048, 6144])
    parser.add_argument("--lead", type=int, default=16, help="chunks the first stream gives before the long prompt")
    parser.add_argument("--quick", action="store_true", help="2,048 tokens only")
    parser.add_argument("--name", default="stalls")
    args = parser.parse_args()
    sizes = [2048] if args.quick else args.prompt_tokens
    from transformers import AutoTokenizer

    from lookahead.models.default_model import default_model_dir

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    process, url = start_server([], 4)
    rows = []
    try:
        for size in sizes:
            # each prompt opens with its own line, so none finds another's prefix in the cache
            asyncio.run(alone(url, long_prompt(tokenizer, size // 8, "(warm-up)")))  # costs measured, kernels loaded
            side = asyncio.run(beside(url, long_prompt(tokenizer, size, "(beside)"), args.lead))
            solo = asyncio.run(alone(url, long_prompt(tokenizer, size, "(alone)")))
            rows.append({"prompt_tokens": size, **side, "ratio": side["max_gap"] / side["median_gap"],
                         "ttft_alone": solo})
            print(f"{size} tokens: largest gap {side['max_gap']:.3f} s, median {side['median_gap']:.3f} s "
                  f"({rows[-1]['ratio']:.1f}x), {side['max_gap_at']:.1f} s after the long prompt came (the ten "
                  f"largest: {side['largest_gaps']}); time to first token {side['ttft']:.1f} s beside a stream, "
                  f"{solo:.1f} s alone", flush=True)
    finally:
        stop_server(process)
    print_table(["prompt tokens", "TTFT beside (s)", "TTFT alone (s)", "stream's median gap (s)",
                 "largest gap (s)", "largest / median"],
                [[r["prompt_tokens"], f"{r['ttft']:.1f}", f"{r['ttft_alone']:.1f}", f"{r['median_gap']:.3f}",
                  f"{r['max_gap']:.3f}", f"{r['ratio']:.1f}x"] for r in rows])
    print("saved", save_json(args.name, {"machine": machine(), "rows": rows, "lead": args.lead}))


if __name__ == "__main__":
    main()
