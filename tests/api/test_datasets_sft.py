"""Chat and completion uploads over the API: checked line by line as they stream in (a 422
listing the bad lines by number), prepared with loss masks by the API's child process, and
the record's report (examples, tokens, the share that carries loss, dropped/truncated)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from tests.api.support import Api
from tests.api.test_datasets import nothing_left, ready, upload
from trainer.data import TokenDataset


def _chat(user: str, answer: str, **extra: Any) -> str:
    messages = [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
    return json.dumps({"messages": messages, **extra})


def _body(lines: list[str]) -> bytes:
    return ("\n".join(lines) + "\n").encode()


def test_a_chat_upload_is_prepared_with_masks_and_reports_them(api: Api) -> None:
    lines = [_chat(f"question {i}?", "answer " * (1 + i % 3)) for i in range(30)]
    lines.append(_chat("long " * 100, "short"))
    found = ready(api, _body(lines), name="chats", format="chat", max_len=200)
    assert found["format"] == "chat" and found["documents"] == 31
    report = found["report"]
    assert report["examples"] == 30 and report["dropped"] == {"too_long": 1}
    assert report["max_len"] == 200 and report["overlong"] == "drop"
    assert report["tokens"] == found["train_tokens"] + found["val_tokens"]
    folder = Path(api.settings.data_root) / found["path"]
    masks = [TokenDataset(folder, split, 1).masks for split in ("train", "val")]
    assert all(m is not None for m in masks)
    targets = sum(int(np.asarray(m).sum()) for ms in masks for m in ms or [])
    assert report["target_tokens"] == targets
    assert report["loss_share"] == round(targets / report["tokens"], 6)
    assert 0 < report["loss_share"] < 0.5


def test_completion_with_truncation_and_train_on_inputs(api: Api) -> None:
    lines = [json.dumps({"prompt": "p" * 50, "completion": "c" * 50})] * 4
    found = ready(
        api, _body(lines), name="pairs", format="completion", max_len=60, overlong="truncate"
    )
    report = found["report"]
    assert report["truncated"] == 4 and report["tokens"] == 4 * 60
    assert report["target_tokens"] == 4 * 10
    everything = ready(api, _body(lines), name="all", format="completion", train_on_inputs=True)
    assert everything["report"]["loss_share"] == 1.0


def test_bad_lines_are_a_422_listing_them_and_leave_nothing(api: Api) -> None:
    lines = [
        _chat("fine", "ok"),
        json.dumps({"messages": [{"role": "robot", "content": "x"}]}),
        "",
        json.dumps({"messages": [{"role": "user", "content": "only a question"}]}),
        '{"messages": [',
    ]
    resp = upload(api, _body(lines), name="bad", format="chat")
    assert resp.status_code == 422, resp.text
    detail = resp.json()["detail"][0]
    assert detail["loc"] == ["body"]
    msg = detail["msg"]
    assert "3 bad line(s)" in msg
    assert 'line 2: messages[0] has role "robot"' in msg
    assert "line 4: has no assistant message" in msg and "line 5: is not JSON" in msg
    nothing_left(api, "bad")
    # Options of chat and completion with another format: a 422 naming the option.
    for option, value in (("max_len", 10), ("overlong", "drop"), ("train_on_inputs", True)):
        resp = upload(api, b"text", name="t", **{option: value})
        assert resp.status_code == 422 and resp.json()["detail"][0]["loc"] == ["query", option]


def test_the_tokenizers_chat_template_renders_and_travels(api: Api) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=80, special_tokens=["[UNK]", "<s>", "</s>"])
    tok.train_from_iterator(["User: Bot: hello world the quick brown fox"] * 20, trainer)
    folder = Path(api.settings.data_root) / f"chat-tok-{api.user}"
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    template = (
        "{% for m in messages %}{% if m.role == 'user' %}User: {{ m.content }}\n"
        "{% else %}Bot: {% generation %}{{ m.content }}{{ eos_token }}{% endgeneration %}\n"
        "{% endif %}{% endfor %}"
    )
    config = {"chat_template": template, "eos_token": "</s>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    lines = [_chat("hello world", "the quick brown fox")] * 10
    found = ready(api, _body(lines), name="templated", format="chat", tokenizer=folder.name)
    assert found["report"]["chat_template"] == "tokenizer"
    data = Path(api.settings.data_root) / found["path"]
    assert json.loads((data / "tokenizer_config.json").read_text()) == config
    ds = TokenDataset(data, "train", 1)
    ids, mask = np.asarray(ds.shards[0]), np.asarray(ds.masks[0])  # type: ignore[index]
    answer = tok.decode(ids[mask == 1][:5].tolist(), skip_special_tokens=False)
    assert answer.split() == ["the", "quick", "brown", "fox", "</s>"]


def test_submit_checks_packing_against_the_dataset(api: Api) -> None:
    from tests.api.test_datasets import TEXT

    def submit(dataset: str, seq_len: int, packing: bool = True) -> Any:
        model = {"n_layer": 1, "n_head": 1, "d_model": 8, "seq_len": seq_len, "vocab_size": 256}
        data = {"dataset": dataset, "packing": packing}
        body = {"queue": api.queue, "train": {"steps": 1, "model": model, "data": data}}
        return api.client.post("/v1/jobs", json=body, headers=api.headers())

    ready(api, TEXT.encode(), name="plain")
    resp = submit("plain", 32)
    assert resp.status_code == 422, resp.text
    detail = resp.json()["detail"][0]
    assert detail["loc"] == ["body", "train", "data", "packing"]
    assert "plain is text data" in detail["msg"]
    lines = [_chat("q" * (5 + i), "a") for i in range(6)]
    found = ready(api, _body(lines), name="qs", format="chat")
    longest = found["report"]["longest"]
    resp = submit("qs", longest - 2)  # one token short: packing would drop the longest
    assert resp.status_code == 422, resp.text
    detail = resp.json()["detail"][0]
    assert detail["loc"] == ["body", "train", "model", "seq_len"]
    assert f"longest example is {longest} tokens" in detail["msg"]
    assert submit("qs", longest - 2, packing=False).status_code == 201  # windows: nothing lost
    assert submit("qs", longest - 1).status_code == 201, "seq_len + 1 = longest fits"
    cut = ready(api, _body(lines), name="cut", format="chat", overlong="truncate")
    assert cut["report"]["longest"] == longest
    assert submit("cut", longest - 2).status_code == 201  # the dataset says: cut it
