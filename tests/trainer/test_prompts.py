"""Prompts as the generators receive them: the model's chat template (Llama 3's and Qwen2.5's, rendered by
transformers itself for comparison), raw text without one, verl's Parquet layout with nested field paths, the
refusals, and `pat data --show`."""

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from tokenizers import processors
from transformers import AutoTokenizer

from pat_operator.api import Dataset
from pat_workers.cli import main
from pat_workers.engine.loader import load_tokenizer
from pat_workers.trainer.data import Problem, load_problems, train_tokenizer
from pat_workers.trainer.prompts import load_prompts

TEMPLATES = Path(__file__).parent / "chat_templates"  # as in the models' tokenizer_config.json
QUESTION = "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May."
INSTRUCTION = "Let's think step by step and output the final answer after \"####\"."
SYSTEM = "You are a careful mathematician."
QWEN_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
# verl's examples/data_preprocess/gsm8k.py: the question and instruction as one user message, the answer in a struct
VERL_ROWS = [{"data_source": "openai/gsm8k",
              "prompt": [{"content": f"{QUESTION} {INSTRUCTION}", "role": "user"}],
              "ability": "math",
              "reward_model": {"ground_truth": "72", "style": "rule"},
              "extra_info": {"answer": "Natalia sold 48/2 = 24 clips in May. #### 72", "index": 0, "split": "train"}},
             {"data_source": "openai/gsm8k",
              "prompt": [{"content": SYSTEM, "role": "system"}, {"content": "What is 2+3?", "role": "user"}],
              "ability": "math",
              "reward_model": {"ground_truth": "5", "style": "rule"},
              "extra_info": {"answer": "2+3 = 5 #### 5", "index": 1, "split": "train"}}]
VERL = Dataset(path="train.parquet", prompt_field="prompt", answer_field="reward_model.ground_truth")
CORPUS = [QUESTION, INSTRUCTION, SYSTEM, QWEN_SYSTEM, "What is 2+3?\n\n3+4= Think. system user assistant 0123456789"]


def tokenizer_dir(path: Path, template: str | None, specials: list[str], config: dict, bos: str | None = None):
    """A Hugging Face tokenizer directory: a small BPE tokenizer.json with the template's special tokens and, like
    Llama 3's, a post-processor that adds `bos`; tokenizer_config.json with the chat template."""
    tokenizer = train_tokenizer(CORPUS, 300, path)
    tokenizer.add_special_tokens(specials)
    if bos:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", special_tokens=[(bos, tokenizer.token_to_id(bos))])
    tokenizer.save(str(path / "tokenizer.json"))
    chat = {"chat_template": template} if template else {}
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", **chat, **config}))
    return path


@pytest.fixture(scope="module")
def llama3(tmp_path_factory):
    return tokenizer_dir(tmp_path_factory.mktemp("llama3"), (TEMPLATES / "llama3.jinja").read_text(),
                         ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
                         {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}, bos="<|begin_of_text|>")


@pytest.fixture(scope="module")
def qwen25(tmp_path_factory):
    return tokenizer_dir(tmp_path_factory.mktemp("qwen2.5"), (TEMPLATES / "qwen2.5.jinja").read_text(),
                         ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                         {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"})


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """The tiny example's kind of tokenizer: tokenizer.json trained on the data, no chat template."""
    path = tmp_path_factory.mktemp("plain")
    train_tokenizer(CORPUS, 300, path)
    return path


@pytest.fixture
def verl_parquet(tmp_path):
    pq.write_table(pa.Table.from_pylist(VERL_ROWS), tmp_path / "train.parquet")
    return tmp_path / "train.parquet"


def reference(tokenizer_path, messages):
    """transformers' own rendering: the text, and the token ids of apply_chat_template(tokenize=True)."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return text, tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)


USER = "What is 2+3?"
EXPECTED = {  # the templates' known output, for a text prompt
    "llama3": f"<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n{USER}<|eot_id|>"
              "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "qwen25": f"<|im_start|>system\n{QWEN_SYSTEM}<|im_end|>\n<|im_start|>user\n{USER}<|im_end|>\n"
              "<|im_start|>assistant\n",
}


@pytest.mark.parametrize("model", ["llama3", "qwen25"])
def test_chat_template_renders_as_transformers_does(request, model):
    path = request.getfixturevalue(model)
    messages = ({"role": "system", "content": SYSTEM}, {"role": "user", "content": USER})
    prompts = load_prompts([Problem(USER, "5"), Problem(messages, "5")], path, Dataset(path="x.jsonl"))
    text, ids = reference(path, [{"role": "user", "content": USER}])  # a text prompt: one user message
    assert prompts.render(0).text == text == EXPECTED[model]
    assert prompts.render(0).token_ids == ids
    assert load_tokenizer(path).decode(ids, skip_special_tokens=False) == text  # every character has a token
    assert (prompts.render(1).text, prompts.render(1).token_ids) == reference(path, list(messages))
    assert SYSTEM in prompts.render(1).text and QWEN_SYSTEM not in prompts.render(1).text


def test_the_template_writes_bos_once(llama3):
    rendered = load_prompts([Problem(USER, "5")], llama3, Dataset(path="x.jsonl")).render(0)
    bos = load_tokenizer(llama3).token_to_id("<|begin_of_text|>")
    assert rendered.token_ids[0] == bos and rendered.token_ids.count(bos) == 1
    # Negative control: tokenizing the rendered text as a plain text would add the post-processor's BOS again.
    assert AutoTokenizer.from_pretrained(llama3).encode(rendered.text)[:2] == [bos, bos]


def test_prompt_template_wraps_a_text_prompt_before_it_becomes_the_user_message(qwen25):
    spec = Dataset(path="x.jsonl", prompt_template="{prompt} Think.")
    (problem,) = load_problems(Dataset(synthetic={"size": 1}, prompt_template="{prompt} Think."))
    rendered = load_prompts([problem], qwen25, spec).render(0)
    assert f"<|im_start|>user\n{problem.prompt}<|im_end|>" in rendered.text and problem.prompt.endswith("= Think.")


def test_chat_template_false_sends_the_raw_text(llama3):
    on = load_prompts([Problem(USER, "5")], llama3, Dataset(path="x.jsonl")).render(0)
    off = load_prompts([Problem(USER, "5")], llama3, Dataset(path="x.jsonl", chat_template=False)).render(0)
    assert off.text == f"<|begin_of_text|>{USER}" != on.text  # the tokenizer's own BOS, no chat format
    assert off.token_ids == load_tokenizer(llama3).encode(USER).ids != on.token_ids


def test_without_a_template_prompts_stay_raw_text(plain):
    """The tiny example's dataset tokenizer: unset chatTemplate means off, the ids those the trainer always sent."""
    rendered = load_prompts([Problem("3+4=", "7")], plain, Dataset(path="x.jsonl")).render(0)
    assert rendered.text == "3+4=" and rendered.token_ids == load_tokenizer(plain).encode("3+4=").ids


def test_chat_template_true_without_one_is_refused(plain, tmp_path):
    with pytest.raises(ValueError, match=r"dataset.chatTemplate is true but the tokenizer in .* has no chat template"):
        load_prompts([Problem(USER, "5")], plain, Dataset(path="x.jsonl", chat_template=True))
    no_template = tokenizer_dir(tmp_path, None, [], {"eos_token": "<|end_of_text|>"})  # a config, no template
    with pytest.raises(ValueError, match="dataset.chatTemplate is true"):
        load_prompts([Problem(USER, "5")], no_template, Dataset(path="x.jsonl", chat_template=True))


def test_chat_messages_without_a_template_are_refused(plain, qwen25):
    messages = Problem(({"role": "user", "content": USER},), "5")
    with pytest.raises(ValueError, match=r"problem 1: dataset.promptField='prompt' holds chat messages, which need a "
                                         r"chat template, but the tokenizer in .* has no chat template"):
        load_prompts([Problem(USER, "5"), messages], plain, Dataset(path="x.jsonl", prompt_field="prompt"))
    with pytest.raises(ValueError, match="problem 0: .* but dataset.chatTemplate is false"):
        load_prompts([messages], qwen25, Dataset(path="x.jsonl", chat_template=False))


def test_a_prompt_template_that_writes_the_chat_format_is_refused_with_a_template(llama3):
    handmade = "<|start_header_id|>user<|end_header_id|>\n\n{prompt}<|eot_id|>"
    with pytest.raises(ValueError, match=r"dataset.promptTemplate writes the chat format itself \(<\|start_header"):
        load_prompts([Problem(USER, "5")], llama3, Dataset(path="x.jsonl", prompt_template=handmade))
    off = Dataset(path="x.jsonl", prompt_template=handmade, chat_template=False)  # as before chat templates
    templated = Problem(handmade.replace("{prompt}", USER), "5")  # what load_problems makes of it
    assert load_prompts([templated], llama3, off).render(0).text == f"<|begin_of_text|>{templated.prompt}"


def test_verl_parquet_loads_as_is_and_renders(verl_parquet, qwen25):
    problems = load_problems(VERL, base_dir=verl_parquet.parent)
    assert problems == [Problem(tuple(m for m in row["prompt"]), row["reward_model"]["ground_truth"])
                        for row in VERL_ROWS]
    assert problems[0].prompt == ({"role": "user", "content": f"{QUESTION} {INSTRUCTION}"},)
    prompts = load_prompts(problems, qwen25, VERL)
    for index, row in enumerate(VERL_ROWS):
        rendered = prompts.render(index)
        assert (rendered.text, rendered.token_ids) == reference(qwen25, row["prompt"])


def test_a_missing_field_path_is_refused_from_the_parquet_schema(verl_parquet):
    columns = ("['data_source', 'prompt', 'ability', 'reward_model', 'reward_model.ground_truth', "
               "'reward_model.style', 'extra_info', 'extra_info.answer', 'extra_info.index', 'extra_info.split']")
    wrong = Dataset(path=str(verl_parquet), prompt_field="prompt", answer_field="reward_model.answer")
    with pytest.raises(ValueError) as refused:
        load_problems(wrong)
    assert str(refused.value) == (f"{verl_parquet}: no column 'reward_model.answer' (columns: {columns}); set "
                                  "dataset.answerField to the column that holds it (a.b: the field b of the struct "
                                  "column a)")
    with pytest.raises(ValueError, match=r"no column 'problem' \(columns: \['data_source', .*set dataset.promptField"):
        load_problems(Dataset(path=str(verl_parquet)))  # the default field names


def test_jsonl_with_nested_objects(tmp_path):
    rows = [{"q": {"text": "1+1="}, "meta": {"answer": 2}}, {"q": {"text": "2+2="}, "meta": {"answer": 4}}]
    (tmp_path / "nested.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = Dataset(path=str(tmp_path / "nested.jsonl"), prompt_field="q.text", answer_field="meta.answer")
    assert load_problems(spec) == [Problem("1+1=", "2"), Problem("2+2=", "4")]
    missing = spec.model_copy(update={"answer_field": "meta.final"})
    with pytest.raises(ValueError, match=r"nested.jsonl:1: field 'meta.final' is missing or null \(fields: \['meta', "
                                         r"'meta.answer', 'q', 'q.text'\]\); set dataset.answerField"):
        load_problems(missing)


@pytest.mark.parametrize("prompt", [
    [{"role": "user"}],  # no content
    [{"role": "user", "content": 3}],
    ["What is 2+3?"],
    [],
])
def test_messages_not_shaped_role_content_are_refused_naming_the_row(tmp_path, prompt):
    lines = [{"prompt": [{"role": "user", "content": USER}], "answer": "5"}, {"prompt": prompt, "answer": "5"}]
    (tmp_path / "bad.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    with pytest.raises(ValueError, match=r"bad.jsonl:2: field 'prompt' is .*; chat messages must be a non-empty list "
                                         r"of \{role: text, content: text\}"):
        load_problems(Dataset(path=str(tmp_path / "bad.jsonl"), prompt_field="prompt"))


def test_parquet_message_rows_are_checked_too(tmp_path):
    rows = [dict(VERL_ROWS[0]), dict(VERL_ROWS[0], prompt=[{"content": None, "role": "user"}])]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    with pytest.raises(ValueError, match=r"train.parquet row 1: field 'prompt' is .*chat messages must be"):
        load_problems(VERL, base_dir=tmp_path)


def test_a_prompt_template_does_not_apply_to_chat_messages(verl_parquet):
    spec = VERL.model_copy(update={"prompt_template": "{prompt} Think."})
    with pytest.raises(ValueError, match="row 0: field 'prompt' holds chat messages, and dataset.promptTemplate "
                                         "applies to text prompts only; leave dataset.promptTemplate out"):
        load_problems(spec, base_dir=verl_parquet.parent)


def job_file(tmp_path, model, dataset) -> Path:
    job = {"apiVersion": "pat.dev/v1alpha1", "kind": "RLHFJob", "metadata": {"name": "verl-gsm8k"},
           "spec": {"model": model, "dataset": dataset}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    return tmp_path / "job.yaml"


def test_pat_data_shows_the_prompts_as_the_generators_receive_them(tmp_path, verl_parquet, qwen25, capsys):
    job = job_file(tmp_path, {"path": str(qwen25)},
                   {"path": "train.parquet", "promptField": "prompt", "answerField": "reward_model.ground_truth"})
    assert main(["data", str(job), "--show", "2", "--data-dir", str(tmp_path)]) == 0
    prompts = load_prompts(load_problems(VERL, base_dir=tmp_path), qwen25, VERL)
    first, second = prompts.render(0), prompts.render(1)
    assert capsys.readouterr().out == (
        f"--- prompt 1 of 2: {len(first.token_ids)} tokens, answer '72'\n{first.text}\n"
        f"--- prompt 2 of 2: {len(second.token_ids)} tokens, answer '5'\n{second.text}\n")
    assert first.text == (f"<|im_start|>system\n{QWEN_SYSTEM}<|im_end|>\n<|im_start|>user\n{QUESTION} {INSTRUCTION}"
                          "<|im_end|>\n<|im_start|>assistant\n")


def test_pat_data_refuses_naming_the_field(tmp_path, verl_parquet, plain, capsys):
    job = job_file(tmp_path, {"path": str(plain)}, {"path": str(verl_parquet), "promptField": "prompt",
                                                    "answerField": "reward_model.ground_truth", "chatTemplate": True})
    assert main(["data", str(job)]) == 2
    assert "pat data: dataset.chatTemplate is true but the tokenizer in" in capsys.readouterr().err


def test_pat_data_builds_the_tiny_models_tokenizer(capsys):
    """examples/local.yaml (model.tiny, tokenizer: dataset): the raw arithmetic prompts, as before."""
    local = Path(__file__).parents[2] / "examples" / "local.yaml"
    assert main(["data", str(local), "--show", "1"]) == 0
    header, text, end = capsys.readouterr().out.split("\n")
    assert header.startswith("--- prompt 1 of 512: ") and text == "3+3=" and end == ""
