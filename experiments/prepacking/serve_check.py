"""The server packing concurrent prompts and answering a shared-context request, end to end on the default model.

Starts ``kvr-serve --nproc 2`` on loopback, sends 6 ShareGPT prompts at once (greedy, 8 tokens) and then the
shipped text with 4 of its shipped questions to ``/v1/ask``, and prints each response's ``kvrunahead.packed_with``,
the packing lines of ``/metrics`` and the answers. Then each of the 6 prompts alone, one after another: the texts
must be the same.

    python experiments/prepacking/serve_check.py > experiments/prepacking/serve_check.txt
"""

import asyncio
import json
import os
import signal
import subprocess
import time
from importlib import resources
from pathlib import Path

import httpx

from kvrunahead.prompt import shipped_text
from kvrunahead.ranks.launcher import free_port

HERE = Path(__file__).parent


async def main() -> None:
    port = free_port()
    server = subprocess.Popen(["kvr-serve", "--nproc", "2", "--port", str(port)], start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient(base_url=base, timeout=600) as http:
            for _ in range(600):
                try:
                    if (await http.get("/health")).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(1)
            prompts = [json.loads(x)["prompt"] for x in (HERE / "sharegpt_16.jsonl").read_text().splitlines()][:6]

            async def complete(prompt: str) -> dict:
                r = await http.post("/v1/chat/completions", json={"model": "smollm2-135m", "max_tokens": 8,
                                                                  "temperature": 0,
                                                                  "messages": [{"role": "user", "content": prompt}]})
                r.raise_for_status()
                return r.json()

            together = await asyncio.gather(*(complete(p) for p in prompts))
            for i, r in enumerate(together):
                print(f"prompt {i}: packed_with {r['kvrunahead']['packed_with']}  degree {r['kvrunahead']['degree']}"
                      f"  boundaries {r['kvrunahead']['partition']['boundaries']}  "
                      f"{r['choices'][0]['message']['content']!r}")
            alone = [await complete(p) for p in prompts]
            same = sum(a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]
                       for a, b in zip(together, alone))
            print(f"packed texts equal to the same prompts sent alone: {same}/{len(prompts)}")
            questions = [q for q in resources.files("kvrunahead.data").joinpath("declaration_questions.txt")
                         .read_text().splitlines() if q.strip()][:4]
            t0 = time.monotonic()
            r = await http.post("/v1/ask", json={"model": "smollm2-135m", "context": shipped_text(),
                                                 "questions": questions, "max_tokens": 16})
            r.raise_for_status()
            body = r.json()
            print(f"/v1/ask: {len(body['answers'])} answers in {time.monotonic() - t0:.1f} s; figures "
                  f"{body['kvrunahead']}; usage {body['usage']}")
            for a in body["answers"]:
                print(f"  {a['question']!r} -> {a['text']!r} ({a['finish_reason']})")
            metrics = (await http.get("/metrics")).text
            print("\n".join(line for line in metrics.splitlines()
                            if line.startswith(("kvr_packed", "kvr_ask"))))
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(60)


if __name__ == "__main__":
    asyncio.run(main())
