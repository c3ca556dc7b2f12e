"""Common-context sets from ShareGPT, deterministically: conversations whose first human turn is long (the context)
and which go on with several short human turns (the questions, one per line, newlines folded to spaces).

Each set is ``sharegpt_sets/context_K.txt`` and ``sharegpt_sets/questions_K.txt``, as ``kvr-ask --context
--questions`` reads them; the first ``SETS`` qualifying conversations of the first 20000 complete records.

    python experiments/shared_context/derive_sharegpt_sets.py
"""

from pathlib import Path

from kvrunahead.bench.serve_bench import count_tokens, open_sharegpt, read_json_records
from kvrunahead.model.load import load_tokenizer

OUT = Path(__file__).parent / "sharegpt_sets"
RECORDS, SETS = 20000, 4
CONTEXT_TOKENS = (800, 3000)  # the first turn's length
QUESTION_TOKENS = (4, 200)
MIN_QUESTIONS = 4


def main() -> None:
    tokenizer = load_tokenizer("smollm2-135m")
    with open_sharegpt() as fp:
        records = read_json_records(fp, limit=RECORDS).items
    OUT.mkdir(exist_ok=True)
    found = 0
    for rec in records:
        humans = [t.get("value") for t in rec.get("conversations") or []
                  if isinstance(t, dict) and t.get("from") == "human" and isinstance(t.get("value"), str)]
        if len(humans) < MIN_QUESTIONS + 1:
            continue
        context, rest = humans[0], [" ".join(h.split()) for h in humans[1:]]
        n_context, *n_rest = count_tokens([context, *rest], tokenizer)
        questions = [q for q, n in zip(rest, n_rest) if q and QUESTION_TOKENS[0] <= n <= QUESTION_TOKENS[1]]
        if not CONTEXT_TOKENS[0] <= n_context <= CONTEXT_TOKENS[1] or len(questions) < MIN_QUESTIONS:
            continue
        (OUT / f"context_{found}.txt").write_text(context, encoding="utf-8")
        (OUT / f"questions_{found}.txt").write_text("\n".join(questions) + "\n", encoding="utf-8")
        print(f"set {found}: {rec.get('id')}: context {n_context} tokens, {len(questions)} questions")
        found += 1
        if found == SETS:
            break


if __name__ == "__main__":
    main()
