"""Problems (prompt, reference answer) from a JSONL/Parquet file or generated, the prompt sampler, and a BPE
tokenizer trained on the dataset's text.

A prompt is text or a list of chat messages {role, content} (verl's `prompt` column); trainer/prompts.py renders
either into what the generators receive. Field names are paths: `reward_model.ground_truth` is the field
ground_truth of the object (JSONL) or struct column (Parquet) reward_model."""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pat_operator.api import Dataset, SyntheticDataset
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from ..engine.tiny import SPECIAL_TOKENS

SUFFIX_FORMATS = {".jsonl": "jsonl", ".parquet": "parquet"}
# synthetic.longTail draws this many lengths per problem, one per sample; more samples per prompt reuse them.
LONG_TAIL_SAMPLES = 64
SHORTEST = 2  # tokens of a short drawn response: room for "#### 7"
TO_THE_CAP = 1 << 31  # a drawn length beyond any maxResponseTokens: the trainer cuts it there
Messages = tuple[dict[str, str], ...]  # chat messages, each {"role": ..., "content": ...}


@dataclass(frozen=True)
class Problem:
    prompt: str | Messages
    answer: str
    # Sample g generates exactly lengths[g % len] tokens (dataset.lengthField, synthetic.longTail); None: to EOS
    lengths: tuple[int, ...] | None = None


def load_problems(spec: Dataset, base_dir: str | Path | None = None) -> list[Problem]:
    """The problems of dataset.path (resolved against `base_dir` when relative) or dataset.synthetic, each text
    prompt passed through dataset.promptTemplate (chat messages are kept as they are)."""
    problems = synthetic_arithmetic(spec.synthetic) if spec.synthetic is not None else _read_file(spec, base_dir)
    # str.replace, not str.format: templates of math prompts are full of LaTeX braces.
    return [replace(p, prompt=spec.prompt_template.replace("{prompt}", p.prompt)) if isinstance(p.prompt, str)
            else p for p in problems]


def _read_file(spec: Dataset, base_dir: str | Path | None) -> list[Problem]:
    path = Path(spec.path)
    if base_dir is not None and not path.is_absolute():
        path = Path(base_dir) / path
    if not path.is_file():
        raise ValueError(f"dataset.path={spec.path!r}: {path} not found")
    fmt = spec.format if spec.format != "auto" else SUFFIX_FORMATS[path.suffix]  # the model checked the suffix
    records = _jsonl_records(path) if fmt == "jsonl" else _parquet_records(path, spec)
    problems = [_problem(record, where, spec) for where, record in records]
    if not problems:
        raise ValueError(f"dataset.path={spec.path!r}: {path} holds no problems; it needs at least one")
    return problems


def _jsonl_records(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e.msg}); each line must be one JSON object") from None
            if not isinstance(record, dict):
                raise ValueError(f"{where}: a {type(record).__name__}, not a JSON object; each line must be one "
                                 "object with the prompt and answer fields")
            yield where, record


def _parquet_records(path: Path, spec: Dataset) -> Iterator[tuple[str, dict[str, Any]]]:
    import pyarrow as pa  # only Parquet datasets need it
    import pyarrow.parquet as pq

    try:
        schema = pq.read_schema(path)
    except pa.ArrowException as e:
        raise ValueError(f"dataset.path={spec.path!r}: {path} is not a readable Parquet file ({e})") from None
    columns = _paths(_schema_tree(schema))
    fields = _fields(spec)
    for option, field in fields:
        if field not in columns:
            raise ValueError(f"{path}: no column {field!r} (columns: {columns}); set dataset.{option} to the "
                             "column that holds it (a.b: the field b of the struct column a)")
    # Whole top-level columns: _lookup walks into their structs, as into a JSON object's.
    table = pq.read_table(path, columns=list(dict.fromkeys(field.split(".")[0] for _, field in fields)))
    for row, record in enumerate(table.to_pylist()):
        yield f"{path} row {row}", record


def _schema_tree(fields: Iterable[Any]) -> dict[str, Any]:
    """A Parquet schema (or struct type) as nested dicts: each column's name, over its fields if it is a struct."""
    import pyarrow as pa

    return {f.name: _schema_tree(f.type) if pa.types.is_struct(f.type) else None for f in fields}


def _paths(record: dict[str, Any], prefix: str = "") -> list[str]:
    """The field paths of a record in order: each key, and key.child for the fields of an object under it."""
    paths = []
    for key, value in record.items():
        paths.append(prefix + key)
        if isinstance(value, dict):
            paths += _paths(value, f"{prefix}{key}.")
    return paths


def _lookup(record: dict[str, Any], path: str) -> Any:
    """The value at a dotted field path (reward_model.ground_truth); None where the path leads nowhere."""
    value: Any = record
    for key in path.split("."):
        value = value.get(key) if isinstance(value, dict) else None
    return value


def _fields(spec: Dataset) -> list[tuple[str, str]]:
    fields = [("promptField", spec.prompt_field), ("answerField", spec.answer_field)]
    return fields + ([("lengthField", spec.length_field)] if spec.length_field else [])


def _problem(record: dict[str, Any], where: str, spec: Dataset) -> Problem:
    values = []
    for option, field in _fields(spec):
        value = _lookup(record, field)
        if value is None:
            raise ValueError(f"{where}: field {field!r} is missing or null (fields: {sorted(_paths(record))}); set "
                             f"dataset.{option} to the field that holds it")
        values.append(value)
    lengths = None
    if spec.length_field:
        value = values.pop()
        lengths = tuple(value) if isinstance(value, list) else (value,)
        if not lengths or any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in lengths):
            raise ValueError(f"{where}: field {spec.length_field!r} is {value!r}; dataset.lengthField must hold a "
                             f"whole number of tokens (1 or more), or a list of them (one per sample)")
    prompt, answer = values
    return Problem(_prompt(prompt, where, spec), str(answer), lengths)  # numeric answers compare as text


def _prompt(value: Any, where: str, spec: Dataset) -> str | Messages:
    """Text (a number becomes text), or chat messages, which a chat template renders."""
    field = spec.prompt_field
    if isinstance(value, str | int | float):
        return str(value)
    if not isinstance(value, list):
        raise ValueError(f"{where}: field {field!r} is a {type(value).__name__}; dataset.promptField must hold "
                         "text or a list of chat messages [{role, content}, ...]")
    if spec.prompt_template != "{prompt}":
        raise ValueError(f"{where}: field {field!r} holds chat messages, and dataset.promptTemplate applies to text "
                         "prompts only; leave dataset.promptTemplate out (put the instruction into the messages)")
    if value and all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                     for m in value):
        return tuple({"role": m["role"], "content": m["content"]} for m in value)
    raise ValueError(f"{where}: field {field!r} is {value!r:.300}; chat messages must be a non-empty list of "
                     "{role: text, content: text}, e.g. [{role: user, content: 'What is 2+3?'}]")


def synthetic_arithmetic(spec: SyntheticDataset) -> list[Problem]:
    """spec.size additions "a+b=" with answer "a+b" (prompt "3+4=", answer "7"); operands drawn uniformly from
    0..spec.max_operand by random.Random(spec.seed), so the seed fixes the problems. With spec.long_tail, each
    problem's response lengths too (long_tail_lengths), from a generator of their own: the problems stay those of
    the seed."""
    rng = random.Random(spec.seed)
    lengths = random.Random(f"{spec.seed}:lengths")  # str seeds hash stably across processes
    problems = []
    for _ in range(spec.size):
        a, b = rng.randint(0, spec.max_operand), rng.randint(0, spec.max_operand)
        tail = None if spec.long_tail is None else long_tail_lengths(lengths, spec.long_tail, LONG_TAIL_SAMPLES)
        problems.append(Problem(f"{a}+{b}=", str(a + b), tail))
    return problems


def long_tail_lengths(rng: random.Random, share: float, n: int) -> tuple[int, ...]:
    """n response lengths: TO_THE_CAP with probability `share`, else a Pareto draw, at least SHORTEST and longer
    than x with probability SHORTEST / x."""
    return tuple(TO_THE_CAP if rng.random() < share else math.ceil(SHORTEST / (1.0 - rng.random()))
                 for _ in range(n))


def write_jsonl(problems: Iterable[Problem], path: str | Path) -> Path:
    """One JSON object a line under the field names dataset.promptField/answerField default to."""
    fields = Dataset.model_fields["prompt_field"].default, Dataset.model_fields["answer_field"].default
    path = Path(path)
    with path.open("w", encoding="utf-8") as f:
        for p in problems:
            f.write(json.dumps(dict(zip(fields, (p.prompt, p.answer)))) + "\n")
    return path


class PromptSampler:
    """Batches of problem indices. Each epoch is a permutation of range(n_problems) determined by (seed,
    epoch); a batch runs on into the next epoch. state_dict() is the cursor, so a restart resumes exactly."""

    def __init__(self, n_problems: int, seed: int):
        if n_problems < 1:
            raise ValueError(f"n_problems={n_problems}: the sampler needs at least one problem")
        self.n_problems, self.seed = n_problems, seed
        self.epoch, self.position = 0, 0
        self._order = self._permutation()

    def _permutation(self) -> list[int]:
        order = list(range(self.n_problems))
        random.Random(f"{self.seed}:{self.epoch}").shuffle(order)  # str seeds hash stably across processes
        return order

    def next_batch(self, size: int) -> list[int]:
        batch: list[int] = []
        while len(batch) < size:
            taken = self._order[self.position:self.position + size - len(batch)]
            batch += taken
            self.position += len(taken)
            if self.position == self.n_problems:
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._permutation()
        return batch

    def state_dict(self) -> dict[str, int]:
        return {"n_problems": self.n_problems, "seed": self.seed, "epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if (state["n_problems"], state["seed"]) != (self.n_problems, self.seed):
            raise ValueError(f"the checkpoint's sampler ran over {state['n_problems']} problems with seed "
                             f"{state['seed']}, this one over {self.n_problems} with seed {self.seed}; resume with "
                             "the dataset and algorithm.seed of the checkpointed run")
        self.epoch, self.position = state["epoch"], state["position"]
        self._order = self._permutation()


def train_tokenizer(texts: Iterable[str], vocab_size: int, path: str | Path) -> Tokenizer:
    """A byte-level BPE tokenizer trained on `texts` (the dataset's prompts and answers), saved as
    path/tokenizer.json. SPECIAL_TOKENS of engine/tiny.py come first (bos 0, eos 1, pad 2); make_tiny_model(
    tokenizer=...) writes those ids into config.json. The alphabet is the bytes that occur in `texts`: other
    characters cannot be encoded."""
    if vocab_size <= len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size={vocab_size} leaves no room beside {len(SPECIAL_TOKENS)} special tokens")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False)
    tokenizer.train_from_iterator(texts, trainer)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path / "tokenizer.json"))
    return tokenizer
