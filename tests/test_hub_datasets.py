"""Prompt sources that name a Hugging Face `datasets` dataset: a dataset saved locally with `datasets`
(no hub here) gives exactly the prompts of the JSONL file it was made from, through `read_source` and
through the `prompts` stage; the known names resolve to the hub datasets the peers train on; a dataset
that cannot be loaded stops with its name and how to give it from disk."""

import json

import pytest
from conftest import GSM8K, SHARED
from typer.testing import CliRunner

from eagle3kit.cli import app
from eagle3kit.core.config import ConfigError, PromptSource, load_config
from eagle3kit.core.rundir import DataError, read_jsonl
from eagle3kit.data.hub_datasets import resolve_dataset
from eagle3kit.data.sources import read_source

MT_BENCH = SHARED / "data" / "prompts" / "mt_bench.jsonl"


def _rows(path):
    return [r for _, r in read_jsonl(path)]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """GSM8K's and MT-bench's JSONL rows saved with `datasets`: as a DatasetDict (`save_to_disk`,
    splits train/test), as a plain Dataset, and as a folder of JSONL data files."""
    import datasets

    d = tmp_path_factory.mktemp("datasets")
    gsm, mt = _rows(GSM8K), _rows(MT_BENCH)
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(gsm), "test": datasets.Dataset.from_list(gsm[:5])}
    ).save_to_disk(str(d / "gsm8k-dict"))
    datasets.Dataset.from_list(mt).save_to_disk(str(d / "mt-bench"))
    (d / "gsm8k-files").mkdir()
    (d / "gsm8k-files" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in gsm))
    return d


@pytest.mark.parametrize(
    "folder, file, slicing, count",
    [
        ("gsm8k-dict", GSM8K, {"stop": -80, "limit": 300}, 300),
        ("gsm8k-dict", GSM8K, {"start": -80}, 80),
        ("gsm8k-files", GSM8K, {"start": 100, "stop": 160}, 60),
        ("mt-bench", MT_BENCH, {"categories": ["writing", "coding"]}, 20),
        ("mt-bench", MT_BENCH, {"exclude_categories": ["math"], "limit": 30}, 30),
    ],
)
def test_a_dataset_saved_with_datasets_reads_the_same_prompts_as_its_jsonl(
    saved, folder, file, slicing, count
):
    from_file, dropped_file = read_source(PromptSource(path=str(file), name="s", **slicing))
    lineage: dict = {}
    from_ds, dropped_ds = read_source(
        PromptSource(dataset=str(saved / folder), name="s", **slicing), lineage=lineage
    )
    assert from_ds == from_file and dropped_ds == dropped_file
    assert len(from_ds) == count
    assert len(lineage["rows_sha256"]) == 64 and lineage["dataset"] == str(saved / folder)


def test_the_prompts_stage_reads_a_dataset_beside_the_config_as_it_reads_the_file(saved, tmp_path):
    """A config naming a dataset folder relative to itself, and one naming the JSONL: the same
    prompts.jsonl and heldout.jsonl; the manifest records the dataset's rows hash, not a file's."""
    import shutil

    shutil.copytree(saved / "gsm8k-dict", tmp_path / "data" / "gsm")
    outs = {}
    for name, source in (
        ("file", f"{{path: {GSM8K}, name: gsm8k, stop: -80, limit: 40}}"),
        ("dataset", "{dataset: data/gsm, split: train, name: gsm8k, stop: -80, limit: 40}"),
    ):
        (tmp_path / f"{name}.yaml").write_text(
            f"run_dir: runs/{name}\nprompts: {{sources: [{source}], heldout_fraction: 0.25}}\n"
        )
        res = CliRunner().invoke(app, ["prompts", "-c", str(tmp_path / f"{name}.yaml")])
        assert res.exit_code == 0, res.output
        outs[name] = tmp_path / "runs" / name
    for f in ("prompts.jsonl", "heldout.jsonl"):
        assert (outs["dataset"] / f).read_text() == (outs["file"] / f).read_text()
    assert len(_rows(outs["dataset"] / "prompts.jsonl")) == 30
    inputs = json.loads((outs["dataset"] / "manifest.json").read_text())["stages"]["prompts"]["inputs"]
    assert (
        inputs["gsm8k"]["dataset"] == str(tmp_path / "data" / "gsm") and inputs["gsm8k"]["split"] == "train"
    )


def test_a_split_the_saved_dataset_lacks_is_refused_naming_its_splits(saved):
    with pytest.raises(DataError, match=r"no split 'validation' \(it has train, test\)"):
        read_source(PromptSource(dataset=str(saved / "gsm8k-dict"), split="validation"))
    test_rows, _ = read_source(PromptSource(dataset=str(saved / "gsm8k-dict"), split="test"))
    assert len(test_rows) == 5


def test_known_names_resolve_to_the_hub_datasets_the_peers_train_on():
    assert resolve_dataset(PromptSource(dataset="gsm8k")) == ("openai/gsm8k", "main", "train", "question")
    assert resolve_dataset(PromptSource(dataset="ultrachat")) == (
        "HuggingFaceH4/ultrachat_200k",
        None,
        "train_sft",
        None,
    )
    assert resolve_dataset(PromptSource(dataset="ShareGPT")) == (
        "Aeala/ShareGPT_Vicuna_unfiltered",
        None,
        "train",
        None,
    )
    # what the source writes wins; an unknown name is a hub id, split train by default
    assert resolve_dataset(PromptSource(dataset="gsm8k", split="test")) == (
        "openai/gsm8k",
        "main",
        "test",
        "question",
    )
    assert resolve_dataset(PromptSource(dataset="org/data", field="q")) == ("org/data", None, "train", "q")


def test_a_dataset_that_cannot_be_loaded_names_it_and_how_to_give_it_from_disk(monkeypatch):
    import datasets

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    with pytest.raises(DataError) as e:
        read_source(PromptSource(dataset="gsm8k", limit=5))
    msg = str(e.value)
    assert "openai/gsm8k (main) [train]" in msg and "save_to_disk(DIR)" in msg and "dataset: DIR" in msg


@pytest.mark.parametrize(
    "source, message",
    [
        ("{path: a.jsonl, dataset: gsm8k}", "not both"),
        ("{name: x}", "not neither"),
        ("{path: a.jsonl, split: test}", "subset and split are read only with dataset"),
    ],
)
def test_a_source_names_a_file_or_a_dataset(tmp_path, source, message):
    (tmp_path / "c.yaml").write_text(f"prompts: {{sources: [{source}]}}\n")
    with pytest.raises(ConfigError, match=message):
        load_config(tmp_path / "c.yaml")


def test_a_saved_dataset_refuses_a_split_or_subset_it_does_not_have_and_a_file_is_a_path(saved, tmp_path):
    with pytest.raises(DataError, match="one saved split with no name: drop split: test"):
        read_source(PromptSource(dataset=str(saved / "mt-bench"), split="test"))
    with pytest.raises(DataError, match="has no subsets: drop subset: main"):
        read_source(PromptSource(dataset=str(saved / "gsm8k-dict"), subset="main"))
    with pytest.raises(DataError, match=r"is a file; give a prompt file as path:"):
        read_source(PromptSource(dataset=str(GSM8K)))
    with pytest.raises(DataError, match="no such folder"):
        read_source(PromptSource(dataset=str(tmp_path / "typo")))


def test_categories_of_any_type_are_read_and_selected_as_text(tmp_path):
    """A list-valued category neither crashes the reader nor matches a filter; a numeric one is
    selected by its text (a config's categories are strings)."""
    import datasets

    rows = [
        {"question": "a", "category": ["x", "y"]},
        {"question": "b", "category": 1},
        {"question": "c", "category": 2},
    ]
    datasets.Dataset.from_list(rows[1:]).save_to_disk(str(tmp_path / "ints"))
    got, _ = read_source(PromptSource(dataset=str(tmp_path / "ints"), categories=["1"]))
    assert [r["messages"][0]["content"] for r in got] == ["b"]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    got, dropped = read_source(PromptSource(path=str(tmp_path / "rows.jsonl"), exclude_categories=["2"]))
    assert [r["messages"][0]["content"] for r in got] == ["a", "b"] and dropped["category_filtered"] == 1


def test_a_changed_source_has_another_fingerprint(tmp_path):
    """What `run` keys the prompts stage on: the same rows saved again keep it, other rows change it."""
    import datasets

    from eagle3kit.data.sources import source_fingerprint

    src = PromptSource(dataset=str(tmp_path / "d"))
    datasets.Dataset.from_list([{"question": "old"}]).save_to_disk(str(tmp_path / "d"))
    first = source_fingerprint(src)
    assert source_fingerprint(src) == first
    datasets.Dataset.from_list([{"question": "new"}]).save_to_disk(str(tmp_path / "d2"))
    import shutil

    shutil.rmtree(tmp_path / "d")
    shutil.move(str(tmp_path / "d2"), str(tmp_path / "d"))
    assert source_fingerprint(src) != first
    (tmp_path / "p.jsonl").write_text('"one"\n')
    before = source_fingerprint(PromptSource(path=str(tmp_path / "p.jsonl")))
    (tmp_path / "p.jsonl").write_text('"two"\n')
    assert source_fingerprint(PromptSource(path=str(tmp_path / "p.jsonl"))) != before


def test_a_relative_dataset_is_stored_absolute_and_a_known_name_is_never_a_local_folder(
    tmp_path, monkeypatch
):
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "gsm8k").mkdir()  # a folder named like a known dataset, beside the config
    (tmp_path / "data").mkdir()
    (tmp_path / "cfg" / "c.yaml").write_text(
        "prompts: {sources: [{dataset: gsm8k}, {dataset: ../data, name: d}, {dataset: ./gsm8k, name: local}]}\n"
    )
    monkeypatch.chdir(tmp_path)
    cfg = load_config("cfg/c.yaml")
    datasets_named = [s.dataset for s in cfg.prompts.sources]
    assert datasets_named == ["gsm8k", str(tmp_path / "data"), str(tmp_path / "cfg" / "gsm8k")]
