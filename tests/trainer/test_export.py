"""trainer.export: a checkpoint of any strategy becomes an ONNX or torch.export file whose
logits are the trained model's."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.trainer import runs
from trainer.config import TrainConfig
from trainer.data import BatchSampler, TokenDataset
from trainer.export import ATOL, ExportError, load_model


def _val_loss(model: torch.nn.Module, cfg: TrainConfig, data_root: Path, world: int) -> float:
    """The trainer's eval, by hand: the same val batches of every rank, averaged."""
    data = TokenDataset(data_root / cfg.data.path, "val", cfg.model.seq_len)
    micro = cfg.batch.micro_batch_size
    losses = []
    with torch.no_grad():
        for rank in range(world):
            sampler = BatchSampler(data, micro, 1, rank, world, cfg.seed)
            losses += [float(model(*sampler.batch(i, 0))) for i in range(cfg.eval.steps)]
    return float(np.mean(losses))


@pytest.mark.parametrize(
    "fixture, cfg, world",
    [
        ("single_run", runs.golden_config(), 1),
        ("ddp_run", runs.config(), 2),
        ("fsdp_run", runs.fsdp_config(), 2),
    ],
)
def test_loaded_weights_are_the_trained_ones(
    fixture: str,
    cfg: dict[str, object],
    world: int,
    data_root: Path,
    request: pytest.FixtureRequest,
) -> None:
    """The model read from the last checkpoint (FSDP's sharded one gathered into one
    process) gives the val loss the run itself logged at that step."""
    run_dir: Path = request.getfixturevalue(fixture)
    model, step = load_model(run_dir)
    logged = {m["step"]: m.get("val_loss") for m in runs.metrics(run_dir)}
    assert step == 20 and logged[step] is not None
    ours = _val_loss(model, TrainConfig.model_validate(cfg), data_root, world)
    assert ours == pytest.approx(logged[step], rel=1e-5)


def _export(run_dir: Path, out: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trainer.export", "--run-dir", str(run_dir), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=runs.REPO,
        umask=0,  # the file's mode is the trainer's policy, not the umask's
    )


@pytest.mark.parametrize("suffix", [".pt2", ".onnx"])
def test_export_reproduces_the_logits(fsdp_run: Path, tmp_path: Path, suffix: str) -> None:
    out = tmp_path / "exports" / f"model{suffix}"
    done = _export(fsdp_run, out)
    assert done.returncode == 0, done.stderr
    assert f"exported step 20 of {fsdp_run}" in done.stdout
    assert [oct(p.stat().st_mode & 0o777) for p in (out.parent, out)] == ["0o750", "0o640"]
    model, _ = load_model(fsdp_run)
    # Another batch size and length than the export traced: both dims are dynamic.
    tokens = torch.randint(
        0, model.cfg.vocab_size, (5, 11), generator=torch.Generator().manual_seed(3)
    )
    with torch.no_grad():
        expected = model(tokens)
    if suffix == ".pt2":
        got = torch.export.load(out).module()(tokens)
    else:
        import onnxruntime

        session = onnxruntime.InferenceSession(str(out), providers=["CPUExecutionProvider"])
        got = torch.from_numpy(session.run(["logits"], {"tokens": tokens.numpy()})[0])
    assert got.shape == (5, 11, model.cfg.vocab_size)
    # The export's own stated tolerance (fp32, absolute): ONNX Runtime's kernels sum in
    # another order than torch's, ~1e-5 apart on logits of magnitude ~3.
    assert (got - expected).abs().max().item() <= ATOL


def test_a_run_without_a_checkpoint_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()
    done = _export(tmp_path / "run", tmp_path / "m.onnx")
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        f"trainer.export: error: no complete checkpoint in {tmp_path / 'run' / 'checkpoints'}: "
        "a run writes one every train.checkpoint.every steps and when it ends; wait for one, "
        "or pass --checkpoint DIR"
    ]
    with pytest.raises(ExportError, match="no complete checkpoint"):
        load_model(tmp_path / "run")


def test_an_old_checkpoint_takes_its_model_from_the_run_config(
    ddp_run: Path, tmp_path: Path
) -> None:
    """Checkpoints written before meta.json named the model: config.json beside them."""
    run_dir = tmp_path / "old"
    shutil.copytree(ddp_run / "checkpoints", run_dir / "checkpoints")
    for meta_path in run_dir.glob("checkpoints/step-*/meta.json"):
        meta = json.loads(meta_path.read_text())
        del meta["model"]
        meta_path.write_text(json.dumps(meta))
    with pytest.raises(ExportError, match="pass --config"):
        load_model(run_dir)
    (run_dir / "config.json").write_text(json.dumps(runs.config()))
    model, _ = load_model(run_dir)
    reference, _ = load_model(ddp_run)
    for (name, a), (_, b) in zip(
        model.state_dict().items(), reference.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name


def _word_tokenizer(path: Path, lines: list[str]) -> None:
    """A word-level Hugging Face tokenizer trained here on a few lines (nothing downloaded)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece()  # joins words with spaces
    tok.train_from_iterator(lines, trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    tok.save(str(path))


def test_hf_export_carries_the_datasets_tokenizer(
    ddp_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run whose dataset was prepared with a tokenizer.json exports it beside the weights,
    and transformers' AutoTokenizer loads it and encodes as the original does."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from trainer.export import main as export_main
    from trainer.prepare import prepare

    lines = [" ".join(runs.WORDS[i:] + runs.WORDS[:i]) + "\n" for i in range(len(runs.WORDS))]
    original, text = tmp_path / "words.json", tmp_path / "words.txt"
    _word_tokenizer(original, lines)
    text.write_text("".join(lines * 20))
    root = tmp_path / "data"
    prepare([text], root / "words", tokenizer=original)
    # A chat dataset keeps the upload's tokenizer_config.json: its chat template travels.
    template = (
        "{% for m in messages %}{{ m.content }} {% endfor %}{% generation %}{% endgeneration %}"
    )
    (root / "words" / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    run_dir = tmp_path / "run"  # the DDP run's weights, as if trained on that dataset
    shutil.copytree(ddp_run / "checkpoints", run_dir / "checkpoints")
    (run_dir / "config.json").write_text(json.dumps(runs.config(data={"path": "words"})))

    out = tmp_path / "exports" / "hf"
    argv = ["--run-dir", str(run_dir), "--out", str(out), "--format", "hf"]
    assert export_main([*argv, "--data-root", str(root)]) == 0, capsys.readouterr().err
    names = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    assert sorted(p.name for p in out.iterdir()) == names
    assert runs.wrong_modes(tmp_path / "exports") == {}
    assert (out / "tokenizer.json").read_bytes() == original.read_bytes()
    loaded = AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert isinstance(loaded, PreTrainedTokenizerFast)
    sample = "the lazy fox runs home and the cat jumps far away zebra"  # zebra: [UNK]
    expected = Tokenizer.from_file(str(original)).encode(sample, add_special_tokens=False).ids
    assert loaded(sample, add_special_tokens=False)["input_ids"] == expected
    assert loaded.decode(expected[:3]) == "the lazy fox"
    assert loaded.chat_template == template
    chat = [{"role": "user", "content": "the lazy"}, {"role": "assistant", "content": "fox"}]
    assert loaded.apply_chat_template(chat, tokenize=False) == "the lazy fox "

    # The same run on a byte-level dataset: an earlier export's tokenizer does not stay.
    (run_dir / "config.json").write_text(json.dumps(runs.config()))
    capsys.readouterr()
    assert export_main([*argv, "--data-root", str(tmp_path / "none")]) == 0
    assert sorted(p.name for p in out.iterdir()) == names[:2]
    assert "(--data-root?): no tokenizer is exported" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args, blocked, code, says",
    [
        (["--run-dir", "{tmp}/nope", "--out", "m.onnx"], None, 1,
         "--run-dir {tmp}/nope is not a folder"),
        (["--run-dir", "{run}", "--out", "m.pt2", "--checkpoint", "{tmp}"], None, 1,
         "(no meta.json)"),
        (["--run-dir", "{run}", "--out", "{tmp}/hf", "--format", "hf"], "transformers", 1,
         "--format hf needs transformers and safetensors (transformers missing): "
         "pip install 'trainq[hf]'"),
        (["--run-dir", "{run}", "--out", "{tmp}/m.onnx"], "onnxscript", 1,
         "pip install 'trainq[export]'"),
        (["--run-dir", "{run}", "--out", "m", "--format", "xyz"], None, 2,
         "argument --format: invalid choice: 'xyz'"),
        (["--run-dir", "{run}", "--out", "m.txt"], None, 2, "name it .onnx or .pt2"),
        (["--out", "m.pt2"], None, 2, "give --run-dir RUN"),
        (["--run-dir", "{run}", "--out", "/proc/no/m.pt2"], None, 1, "cannot write /proc/no/m.pt2"),
    ],
)  # fmt: skip
def test_export_errors_are_one_line_with_the_fix(
    ddp_run: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    args: list[str],
    blocked: str | None,
    code: int,
    says: str,
) -> None:
    from trainer.export import main

    if blocked is not None:
        monkeypatch.setitem(sys.modules, blocked, None)  # what find_spec sees: not installed
    argv = [a.format(tmp=tmp_path, run=ddp_run) for a in args]
    try:
        got = main(argv)
    except SystemExit as exc:  # argparse's usage errors
        got = exc.code  # type: ignore[assignment]
    err = capsys.readouterr().err
    assert got == code, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert "error: " in lines[0] and says.format(tmp=tmp_path) in lines[0], lines[0]
    assert not (tmp_path / "hf").exists()  # a missing extra is found before anything is written


def test_missing_extra_takes_an_import_probe() -> None:
    from trainer.export import missing_extra

    assert missing_extra("pt2", lambda _: None) is None  # torch alone
    assert missing_extra("hf", lambda name: object()) is None
    only = missing_extra("hf", lambda name: None if name == "safetensors" else object())
    assert only == (
        "--format hf needs transformers and safetensors (safetensors missing): "
        "pip install 'trainq[hf]'"
    )
