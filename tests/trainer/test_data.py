"""Problems from files and from the synthetic task, the prompt sampler's resumable order, the dataset tokenizer."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pat_operator.api import Dataset, SyntheticDataset
from pat_workers.engine.loader import load_tokenizer
from pat_workers.trainer.data import (LONG_TAIL_SAMPLES, SHORTEST, TO_THE_CAP, Problem, PromptSampler, load_problems,
                                      synthetic_arithmetic, train_tokenizer, write_jsonl)

DEEPSCALER_ROWS = [
    {"problem": "What is $\\frac{1}{2}+\\frac{1}{3}$?", "answer": "\\frac{5}{6}", "solution": "..."},
    {"problem": "Compute $2^{10}$.", "answer": 1024, "solution": "..."},
]


def write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_jsonl_with_deepscaler_fields_and_a_template(tmp_path):
    write_lines(tmp_path / "train.jsonl", [json.dumps(r) for r in DEEPSCALER_ROWS] + [""])
    spec = Dataset(path="train.jsonl", prompt_template="{prompt} Put the answer in \\boxed{}.")
    problems = load_problems(spec, base_dir=tmp_path)
    assert problems == [
        Problem("What is $\\frac{1}{2}+\\frac{1}{3}$? Put the answer in \\boxed{}.", "\\frac{5}{6}"),
        Problem("Compute $2^{10}$. Put the answer in \\boxed{}.", "1024"),  # a JSON number becomes text
    ]


def test_parquet_with_other_field_names(tmp_path):
    table = pa.table({"question": ["1+1=", "2+2="], "final": ["2", "4"], "other": [0, 1]})
    pq.write_table(table, tmp_path / "gsm.parquet")
    spec = Dataset(path=str(tmp_path / "gsm.parquet"), prompt_field="question", answer_field="final")
    assert load_problems(spec) == [Problem("1+1=", "2"), Problem("2+2=", "4")]
    with pytest.raises(ValueError, match=r"no column 'problem' \(columns: \['question', 'final', 'other'\]\); "
                                         r"set dataset.promptField"):
        load_problems(Dataset(path=str(tmp_path / "gsm.parquet")))
    pq.write_table(pa.table({"problem": ["1+1=", None], "answer": ["2", "4"]}), tmp_path / "null.parquet")
    with pytest.raises(ValueError, match="null.parquet row 1: field 'problem' is missing or null"):
        load_problems(Dataset(path=str(tmp_path / "null.parquet")))


def test_length_field_gives_exact_lengths_per_problem_or_per_sample(tmp_path):
    write_lines(tmp_path / "tail.jsonl", ['{"problem": "1+1=", "answer": 2, "n": [300, 8]}',
                                          '{"problem": "2+2=", "answer": 4, "n": 8}'])
    problems = load_problems(Dataset(path=str(tmp_path / "tail.jsonl"), length_field="n"))
    assert [p.lengths for p in problems] == [(300, 8), (8,)]
    write_lines(tmp_path / "bad.jsonl", ['{"problem": "1+1=", "answer": 2, "n": [300, 0]}'])
    with pytest.raises(ValueError, match=r"bad.jsonl:1: field 'n' is \[300, 0\]; dataset.lengthField must hold"):
        load_problems(Dataset(path=str(tmp_path / "bad.jsonl"), length_field="n"))
    with pytest.raises(ValueError, match=r"tail.jsonl:1: field 'len' is missing or null .* set dataset.lengthField"):
        load_problems(Dataset(path=str(tmp_path / "tail.jsonl"), length_field="len"))


@pytest.mark.parametrize("lines,message", [
    (['{"problem": "1+1=", "answer": "2"}', '{"question": "x", "answer": "1"}'],
     r"bad.jsonl:2: field 'problem' is missing or null \(fields: \['answer', 'question'\]\); set dataset.promptField"),
    (['{"problem": "1+1=", "answer": "2"}', '{"problem": "x"'], r"bad.jsonl:2: not valid JSON"),
    (['["1+1=", "2"]'], r"bad.jsonl:1: a list, not a JSON object"),
    ([], r"holds no problems"),
])
def test_jsonl_errors_name_the_file_line_and_field(tmp_path, lines, message):
    write_lines(tmp_path / "bad.jsonl", lines)
    with pytest.raises(ValueError, match=message):
        load_problems(Dataset(path=str(tmp_path / "bad.jsonl")))


def test_file_errors(tmp_path):
    with pytest.raises(ValueError, match="dataset.path='missing.jsonl': .* not found"):
        load_problems(Dataset(path="missing.jsonl"), base_dir=tmp_path)
    (tmp_path / "data.txt").write_text('{"problem": "1", "answer": "1"}\n')
    with pytest.raises(ValueError, match=r"name it \*.jsonl or \*.parquet, or set dataset.format"):
        Dataset(path=str(tmp_path / "data.txt"))
    assert load_problems(Dataset(path=str(tmp_path / "data.txt"), format="jsonl")) == [Problem("1", "1")]
    with pytest.raises(ValueError, match="not a readable Parquet file"):
        load_problems(Dataset(path=str(tmp_path / "data.txt"), format="parquet"))


def test_synthetic_arithmetic_is_seed_determined():
    spec = SyntheticDataset(size=50, seed=3, max_operand=9)
    problems = synthetic_arithmetic(spec)
    assert problems == synthetic_arithmetic(spec)
    assert problems != synthetic_arithmetic(SyntheticDataset(size=50, seed=4, max_operand=9))
    for p in problems:
        a, b = p.prompt.removesuffix("=").split("+")
        assert p.prompt.endswith("=") and 0 <= int(a) <= 9 and 0 <= int(b) <= 9 and p.answer == str(int(a) + int(b))
    assert len({p.prompt for p in problems}) > 25  # operands vary


def test_synthetic_long_tail_draws_a_length_per_sample():
    plain = synthetic_arithmetic(SyntheticDataset(size=400, seed=3))
    spec = SyntheticDataset(size=400, seed=3, long_tail=0.05)
    problems = synthetic_arithmetic(spec)
    assert problems == synthetic_arithmetic(spec)  # the seed fixes the lengths too
    assert [(p.prompt, p.answer) for p in problems] == [(p.prompt, p.answer) for p in plain]  # ... not the problems
    assert all(p.lengths is None for p in plain)
    lengths = [n for p in problems for n in p.lengths]
    assert len(lengths) == 400 * LONG_TAIL_SAMPLES and min(lengths) > SHORTEST
    at_cap = sum(n == TO_THE_CAP for n in lengths) / len(lengths)
    short = [n for n in lengths if n != TO_THE_CAP]
    assert 0.04 < at_cap < 0.06  # longTail: the share that runs to the cap
    for x in (4, 16, 64):  # the others: longer than x with probability SHORTEST / x
        assert sum(n > x for n in short) / len(short) == pytest.approx(SHORTEST / x, rel=0.1)
    assert {n for p in synthetic_arithmetic(SyntheticDataset(size=50, long_tail=1)) for n in p.lengths} == {TO_THE_CAP}


def test_synthetic_spec_and_jsonl_round_trip(tmp_path):
    spec = Dataset(synthetic=SyntheticDataset(size=5), prompt_template="Q: {prompt}")
    problems = load_problems(spec)
    assert problems[0].prompt.startswith("Q: ") and len(problems) == 5
    path = write_jsonl(synthetic_arithmetic(SyntheticDataset(size=5)), tmp_path / "arith.jsonl")
    assert load_problems(Dataset(path=str(path), prompt_template="Q: {prompt}")) == problems


def test_sampler_covers_each_epoch_and_resumes_exactly():
    sampler = PromptSampler(10, seed=7)
    batches = [sampler.next_batch(4) for _ in range(5)]  # 20 indices: two epochs, batches crossing their ends
    flat = [i for b in batches for i in b]
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:]) == list(range(10))
    assert flat[:10] != flat[10:]  # reshuffled
    assert flat[:10] != list(range(10))
    again = PromptSampler(10, seed=7)
    assert [again.next_batch(4) for _ in range(5)] == batches  # deterministic from the seed
    other = PromptSampler(10, seed=8)
    assert [other.next_batch(4) for _ in range(5)] != batches

    first = PromptSampler(10, seed=7)
    first.next_batch(4), first.next_batch(4), first.next_batch(3)
    state = first.state_dict()
    resumed = PromptSampler(10, seed=7)
    resumed.load_state_dict(state)
    assert [resumed.next_batch(6) for _ in range(3)] == [first.next_batch(6) for _ in range(3)]
    with pytest.raises(ValueError, match="resume with the dataset and algorithm.seed"):
        PromptSampler(11, seed=7).load_state_dict(state)


def test_trained_tokenizer_has_the_special_tokens_and_round_trips(tmp_path):
    texts = [p.prompt + " #### " + p.answer for p in synthetic_arithmetic(SyntheticDataset(size=200))]
    tokenizer = train_tokenizer(texts, vocab_size=48, path=tmp_path)
    loaded = load_tokenizer(tmp_path)
    assert [loaded.token_to_id(t) for t in ("<|begin_of_text|>", "<|end_of_text|>", "<|pad|>")] == [0, 1, 2]
    assert 20 < loaded.get_vocab_size() <= 48
    for text in texts[:20]:
        ids = loaded.encode(text).ids
        assert ids == tokenizer.encode(text).ids and loaded.decode(ids) == text
    assert loaded.decode([1] + loaded.encode("3+4=").ids + [1]) == "3+4="  # specials are skipped
    assert len(loaded.encode("12+13= #### 25").ids) < len("12+13= #### 25")  # merges were learnt
