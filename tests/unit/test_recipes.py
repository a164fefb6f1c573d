"""Recipes (issue 16): the catalog and its overrides, `tidal submit --recipe`, token files,
the learning-rate schedule, the published sizes, and a recipe trained in this process."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tidal.controller.submission import SubmitUsageError, parse_submit
from tidal.proto import common_pb2
from tidal.recipes import catalog
from tidal.recipes.tokens import BYTE_EOS_ID, PackedSequences, TokenFileError, read_header, tokenize

TIDAL = str(Path(sys.executable).parent / "tidal")


@pytest.fixture
def tokens(tmp_path: Path) -> Path:
    text = tmp_path / "corpus.txt"
    text.write_text("the cat sat on the mat\n" * 200)
    return tokenize([text], tmp_path / "corpus.tokens").path


def test_the_shipped_recipes_are_listed_with_their_sizes_default_first() -> None:
    found = catalog.available()
    assert {"llama3", "gpt-oss"} <= set(found)
    rows = {row[0]: row for row in catalog.summary_rows(found.items())}
    assert rows["llama3"][1:3] == ["llama", "tiny, 1b, 8b, 70b"]
    assert rows["gpt-oss"][1:3] == ["gpt_oss", "tiny, 20b, 120b"]


def test_a_folder_on_the_recipes_path_comes_first(tmp_path: Path) -> None:
    (tmp_path / "llama3.yaml").write_text("name: mine\n")
    env = {"TIDAL_RECIPES_PATH": str(tmp_path)}
    assert catalog.available(env)["llama3"] == tmp_path / "llama3.yaml"
    assert catalog.load("llama3", env)["name"] == "mine"
    with pytest.raises(catalog.RecipeError, match=r"no recipe 'nope'.*llama3"):
        catalog.load("nope", env)
    (tmp_path / "broken.yaml").write_text("model: [unclosed\n")
    with pytest.raises(catalog.RecipeError, match=r"broken\.yaml"):
        catalog.load("broken", env)


def test_overrides_keep_the_recipes_keys_and_types(tokens: Path) -> None:
    recipe = catalog.resolve("llama3", [f"data.tokens={tokens}", "optimizer.lr=3e-4", "train.steps=7",
                                        "optimizer.max_grad_norm=2", "model.config.vocab_size=1024",
                                        "model.config.rope_parameters.rope_theta=10000",
                                        "train.simulate.accelerator=h100", "optimizer.max_grad_norm=null"])
    assert recipe["optimizer"]["lr"] == 3e-4 and recipe["train"]["steps"] == 7
    assert recipe["optimizer"]["max_grad_norm"] is None
    assert recipe["model"]["config"] == {"vocab_size": 1024, "rope_parameters": {"rope_theta": 10000}}
    assert catalog.model_config(recipe)["vocab_size"] == 1024
    assert recipe["train"]["simulate"] == {"accelerator": "h100"}
    for assignment, message in (("train.stepz=3", "no 'train.stepz' .*steps"),
                                ("train.steps=abc", "'abc' is not of the type.*int: 200"),
                                ("train.steps=1.5", "1.5 is not of the type"),
                                ("nothing", "not KEY=VALUE"), ("optimizer.lr.x=1", "'optimizer.lr' is not a section"),
                                ("train.dtype=float16", "train.dtype: 'float16' is not one of")):
        with pytest.raises(catalog.RecipeError, match=message):
            catalog.resolve("llama3", [f"data.tokens={tokens}", assignment])


def test_a_recipe_that_cannot_run_is_refused_naming_every_problem(tokens: Path, tmp_path: Path) -> None:
    with pytest.raises(catalog.RecipeError, match=r"data\.tokens: give the token file"):
        catalog.resolve("gpt-oss")
    with pytest.raises(catalog.RecipeError, match=r"no such file"):
        catalog.resolve("gpt-oss", ["data.tokens=missing.tokens"], cwd=tmp_path)
    with pytest.raises(catalog.RecipeError) as refused:
        catalog.resolve("gpt-oss", [f"data.tokens={tokens}", "train.global_batch_tokens=100",
                                    "model.size=huge", "model.config.vocab_size=100", "optimizer.min_lr_ratio=2"])
    for problem in ("not a multiple of data.sequence_length 64", "model.size: 'huge' is not one of",
                    "vocabulary (257) is larger than the model's vocab_size (100)", "min_lr_ratio"):
        assert problem in str(refused.value)
    relative = catalog.resolve("llama3", ["data.tokens=corpus.tokens", "output.dir=out"], cwd=tmp_path)
    assert relative["data"]["tokens"] == str(tmp_path / "corpus.tokens")
    assert relative["output"]["dir"] == str(tmp_path / "out")


def test_submit_with_a_recipe_is_a_live_job_of_the_recipes_shape_under_the_command_line(tokens: Path,
                                                                                         tmp_path: Path) -> None:
    submission = parse_submit(["--recipe", "gpt-oss", "--set", f"data.tokens={tokens}", "--set", "train.steps=9",
                               "--max-replicas", "3", "-p", "train"], cwd=tmp_path)
    spec = submission.spec
    assert spec.mode == common_pb2.JOB_MODE_LIVE
    assert (spec.min_replicas, spec.max_replicas, spec.procs_per_node) == (1, 3, 2)
    assert spec.global_batch == 2048 // 64 and spec.partition == "train" and spec.name == "gpt-oss-tiny"
    assert spec.command[:4] == [sys.executable, "-m", "tidal.recipes.run", "--config"]
    sent = json.loads(spec.command[4])
    assert sent["train"]["steps"] == 9 and sent["data"]["tokens"] == str(tokens) and not catalog.check(sent)
    for argv, message in ((["--set", "train.steps=9", "python", "x.py"], "--set needs one --recipe"),
                          (["--recipe", "llama3", "--set", f"data.tokens={tokens}", "python", "x.py"],
                           "no script or command after it"),
                          (["--recipe", "llama3", "--set", f"data.tokens={tokens}", "--mode", "restart"],
                           "live mode"),
                          (["--recipe", "llama3", "--set", "train.nope=1"], "no 'train.nope'")):
        with pytest.raises(SubmitUsageError, match=message):
            parse_submit(argv, cwd=tmp_path)


def test_the_cli_lists_shows_and_checks_recipes(tokens: Path) -> None:
    listed = subprocess.run([TIDAL, "recipes"], capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0 and "llama3" in listed.stdout and "gpt_oss" in listed.stdout
    shown = subprocess.run([TIDAL, "recipes", "llama3"], capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0 and "global_batch_tokens" in shown.stdout
    resolved = subprocess.run([TIDAL, "recipes", "llama3", "--set", f"data.tokens={tokens}", "--set",
                               "model.size=8b"], capture_output=True, text=True, timeout=60)
    assert resolved.returncode == 0, resolved.stderr
    assert json.loads(resolved.stdout)["model"]["size"] == "8b"
    refused = subprocess.run([TIDAL, "recipes", "llama3", "--set", "model.size=9b"], capture_output=True,
                             text=True, timeout=60)
    assert refused.returncode == 2 and "model.size: '9b'" in refused.stderr


def test_byte_level_tokens_are_the_texts_bytes_with_an_end_between_documents(tmp_path: Path) -> None:
    first, second = tmp_path / "a.txt", tmp_path / "b.jsonl"
    first.write_text("héllo\nworld\n")
    second.write_text(json.dumps({"text": "one"}) + "\n\n" + json.dumps({"text": "two"}) + "\n")
    written = tokenize([first, second], tmp_path / "out" / "t.tokens")
    expected = [*"héllo\nworld\n".encode(), BYTE_EOS_ID, *b"one", BYTE_EOS_ID, *b"two", BYTE_EOS_ID]
    assert written.header.tokens == len(expected) and written.header.documents == 3
    assert written.header.dtype == "uint16" and written.header.vocab_size == 257
    sequences = PackedSequences(written.path, 4)
    assert len(sequences) == (len(expected) - 1) // 4
    assert sequences[0].tolist() == expected[0:5] and sequences[2].tolist() == expected[8:13]
    with pytest.raises(IndexError):
        sequences[len(sequences)]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["t.tokens", "t.tokens.json"]


def test_bad_text_and_damaged_token_files_are_refused_clearly(tmp_path: Path, tokens: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\nnot json\n')
    with pytest.raises(TokenFileError, match=r"bad\.jsonl:2: not a JSON object"):
        tokenize([bad], tmp_path / "bad.tokens")
    assert not list(tmp_path.glob("*bad.tokens*")), "nothing half-written is left"
    with pytest.raises(TokenFileError, match="no such file"):
        tokenize([tmp_path / "absent.txt"], tmp_path / "x.tokens")
    with tokens.open("ab") as grown:
        grown.write(b"\0")
    with pytest.raises(TokenFileError, match="header says"):
        read_header(tokens)
    tokens.with_name(tokens.name + ".json").unlink()
    with pytest.raises(TokenFileError, match="no header"):
        PackedSequences(tokens, 8)


def test_a_local_hugging_face_tokenizer_writes_its_ids(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    text = tmp_path / "corpus.txt"
    text.write_text("the cat sat on the mat and the dog sat on the log\n" * 50)
    raw = Tokenizer(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.train([str(text)], trainers.BpeTrainer(vocab_size=60, special_tokens=["<unk>", "</s>"]))
    folder = tmp_path / "tokenizer"
    PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="</s>", unk_token="<unk>").save_pretrained(folder)
    result = subprocess.run([TIDAL, "data", "tokenize", str(text), "-o", str(tmp_path / "hf.tokens"), "--tokenizer",
                             str(folder)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    header = read_header(tmp_path / "hf.tokens")
    assert header.tokenizer == {"kind": "huggingface", "path": str(folder)}
    assert header.eos_id == raw.token_to_id("</s>") and header.vocab_size == raw.get_vocab_size()
    ids = PackedSequences(tmp_path / "hf.tokens", header.tokens - 1)[0].tolist()
    assert ids[-1] == header.eos_id and ids[:-1] == raw.encode(text.read_text()).ids
    missing = subprocess.run([TIDAL, "data", "tokenize", str(text), "-o", str(tmp_path / "x.tokens"), "--tokenizer",
                              str(tmp_path / "nowhere")], capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and "not a folder" in missing.stderr


def test_the_learning_rate_warms_up_then_follows_a_cosine_to_its_floor() -> None:
    from tidal.recipes.run import lr_factor

    factors = [lr_factor(step, warmup_steps=10, total_steps=110, min_ratio=0.1) for step in range(111)]
    assert factors[0] == pytest.approx(0.1) and factors[9] == pytest.approx(1.0)
    assert factors[10] == pytest.approx(1.0) and factors[60] == pytest.approx(0.55)
    assert factors[110] == pytest.approx(0.1)
    assert all(a >= b for a, b in itertools.pairwise(factors[10:]))


@pytest.mark.parametrize(("name", "size", "parameters"), [
    ("llama3", "1b", 1_235_814_400), ("llama3", "8b", 8_030_261_248), ("llama3", "70b", 70_553_706_496),
    ("gpt-oss", "20b", 20_914_757_184), ("gpt-oss", "120b", 116_829_156_672)])
def test_the_real_sizes_are_the_published_models(name: str, size: str, parameters: int) -> None:
    """Built on the meta device (no memory): the parameter counts of Llama 3.2 1B, Llama 3.1
    8B and 70B, gpt-oss-20b and gpt-oss-120b."""
    pytest.importorskip("transformers")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    recipe = catalog.load(name)
    recipe["model"]["size"] = size
    config = AutoConfig.for_model(recipe["model"]["type"], **catalog.model_config(recipe))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in model.parameters()) == parameters


@pytest.mark.parametrize("name", ["llama3", "gpt-oss"])
def test_a_tiny_recipe_trains_alone_and_writes_weights_that_transformers_loads(name: str, tokens: Path,
                                                                                tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    import torch
    from transformers import AutoModelForCausalLM

    result = subprocess.run(
        [sys.executable, "-m", "tidal.recipes.run", "--recipe", name, "--set", f"data.tokens={tokens}", "--set",
         "train.steps=12", "--set", "train.log_every=6", "--set", "optimizer.warmup_steps=3", "--set",
         f"output.dir={tmp_path / 'out'}", "--set", "data.sequence_length=16", "--set",
         "train.global_batch_tokens=256"],
        capture_output=True, text=True, timeout=300, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [float(line.split()[3]) for line in result.stdout.splitlines() if line.startswith("step ")]
    assert len(losses) == 2 and losses[1] < losses[0], result.stdout
    assert "grad_norm" in result.stdout
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["steps"] == 12 and summary["tokens"] == 12 * 256
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", local_files_only=True)
    with torch.no_grad():
        logits = loaded(input_ids=PackedSequences(tokens, 16)[0][None, :-1]).logits
    assert logits.shape == (1, 16, loaded.config.vocab_size) and torch.isfinite(logits).all()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_replica_sharded_over_two_gloo_workers_trains_in_single_and_mixed_precision(dtype: str, tokens: Path,
                                                                                      tmp_path: Path) -> None:
    """HybridSharded over a unit of two workers (torchrun) in float32 and bfloat16 (FSDP2's
    mixed precision): gloo has no PREMUL_SUM, so FSDP2 must reduce with plain sums. The
    losses are one process's, to float32's and bfloat16's rounding."""
    pytest.importorskip("transformers")
    common = ["--recipe", "llama3", "--set", f"data.tokens={tokens}", "--set", "train.steps=4", "--set",
              "train.log_every=1", "--set", "data.sequence_length=16", "--set", "train.global_batch_tokens=256",
              "--set", f"train.dtype={dtype}"]
    env = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    torchrun = str(Path(sys.executable).parent / "torchrun")
    # The one-process run goes beside torchrun's two workers (3 processes on the 2 cores).
    processes = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
                 for command in ([torchrun, "--standalone", "--nproc-per-node", "2", "-m", "tidal.recipes.run",
                                  *common], [sys.executable, "-m", "tidal.recipes.run", *common])]
    outputs: list[subprocess.CompletedProcess[str]] = []
    try:
        for process in processes:
            stdout, stderr = process.communicate(timeout=180)
            outputs.append(subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr))
    except subprocess.TimeoutExpired:
        # torchrun stops its workers on SIGTERM (they run in sessions of their own: a
        # SIGKILL of torchrun would leave them).
        for process in processes:
            if process.poll() is None:
                process.terminate()
                try:
                    process.communicate(timeout=60)
                finally:
                    process.kill()
        pytest.fail("the runs did not finish 4 steps in 180 s")
    sharded, alone = outputs
    assert sharded.returncode == 0, sharded.stderr[-3000:]
    assert alone.returncode == 0, alone.stderr[-3000:]

    def losses(output: str) -> list[float]:
        return [float(line.split()[3]) for line in output.splitlines() if line.startswith("step ")]

    assert len(losses(sharded.stdout)) == 4 and "world 2" in sharded.stdout
    assert losses(sharded.stdout) == pytest.approx(losses(alone.stdout), rel=1e-4 if dtype == "float32" else 2e-2)
