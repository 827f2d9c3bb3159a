import json

import pytest
import torch

from data.corpus import batch_condition
from decode.conditions import balanced_class_ids, load_prompts


def test_shipped_smoke_prompts():
    prompts = load_prompts("smoke")
    assert len(prompts) == 32 and all(isinstance(p, str) and p for p in prompts)
    assert load_prompts("smoke", limit=3) == prompts[:3]


@pytest.mark.parametrize("suffix", [".jsonl", ".csv", ".txt"])
def test_local_prompt_files(tmp_path, suffix):
    captions = ["a cat", "a dog on a sofa", "two birds"]
    path = tmp_path / f"captions{suffix}"
    if suffix == ".jsonl":
        path.write_text("".join(json.dumps({"caption": c, "id": i}) + "\n" for i, c in enumerate(captions)))
    elif suffix == ".csv":
        path.write_text("id,caption\n" + "".join(f"{i},{c}\n" for i, c in enumerate(captions)))
    else:
        path.write_text("\n".join(captions) + "\n\n")
    assert load_prompts(str(path)) == captions


def test_prompt_errors_name_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="shipped sets"):
        load_prompts(str(tmp_path / "missing.jsonl"))
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"text": "a cat"}) + "\n")
    with pytest.raises(ValueError, match="prompt column 'caption' not in \\['text'\\]"):
        load_prompts(str(path))
    assert load_prompts(str(path), column="text") == ["a cat"]


def test_balanced_class_ids_cover_all_classes():
    ids = balanced_class_ids(2500, 1000)
    assert torch.bincount(ids).tolist() == [3] * 500 + [2] * 500


def test_batch_condition():
    assert batch_condition({"class_id": torch.tensor([1, 2])}).class_ids.tolist() == [1, 2]
    assert batch_condition({"prompt": ("a", "b")}).prompts == ["a", "b"]
    with pytest.raises(KeyError, match="class_id"):
        batch_condition({"tokens": torch.zeros(1)})
