"""The recipes as written: every example config loads and validates (the ones a user copies name hub
datasets, never this project's ../shared files), and every `eagle3kit …` command in the install page
and the recipe pages names a command that exists, with options it takes, and config files that exist
(what each recipe's commands do is run by the tests each page names)."""

import re
import shlex
from pathlib import Path

import pytest
import typer

from eagle3kit.cli import app
from eagle3kit.core.config import load_config

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
PAGES = [
    REPO / "README.md",
    *(REPO / "docs" / f for f in ("index.md", "getting-started.md", "install.md", "choosing.md")),
    *sorted((REPO / "docs" / "recipes").glob("*.md")),
]
#: configs a page writes out in full in a yaml block, for the user to save (checked by the last test)
WRITTEN_ON_THE_PAGE = {"my-model.yaml"}
SHELL_ENDS = {">", ">>", "|", "&", "&&", ";", "2>&1"}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_each_example_config_loads_and_names_data_a_clone_can_reach(path):
    cfg = load_config(path)
    sources = list(cfg.prompts.sources) + list(cfg.evaluate.sets)
    if path.name.endswith(
        "-shared-data.yaml"
    ):  # this project's variant: the shared files beside the checkout
        assert sources and all(s.path and Path(s.path).is_file() for s in sources)
    else:  # what a user copies: hub datasets by name or id, nothing from ../shared
        assert all(s.dataset and not Path(s.dataset).exists() for s in sources), path
    assert Path(cfg.run_dir).parent == path.parent / "runs"  # a relative run_dir lands beside the config


def _commands(page: Path):
    """``(line, argv after "eagle3kit")`` of every eagle3kit command in the page's bash blocks
    (line continuations joined; `torchrun … -m eagle3kit …` included; shell variables read as 0)."""
    for block in re.findall(r"```bash\n(.*?)```", page.read_text(), re.S):
        for line in block.replace("\\\n", " ").splitlines():
            code = re.sub(r"\$\w+", "0", line.split(" #")[0])
            if "eagle3kit " not in code or code.lstrip().startswith(("pip ", "python -m venv")):
                continue
            words = shlex.split(code)
            start = next(i for i, w in enumerate(words) if w == "eagle3kit" or w.endswith("/eagle3kit")) + 1
            argv = []
            for w in words[start:]:
                if w in SHELL_ENDS or w.startswith(">"):
                    break
                argv.append(w)
            yield line.strip(), argv


def test_every_eagle3kit_command_in_the_install_and_recipe_pages_parses():
    group = typer.main.get_command(app)
    seen = 0
    for page in PAGES:
        for line, argv in _commands(page):
            if not argv or argv == ["--help"]:
                continue
            name, args = argv[0], argv[1:]
            assert name in group.commands, f"{page.name}: `{line}`: no command {name!r}"
            ctx = group.commands[name].make_context(name, list(args))  # unknown options and bad values raise
            for key in ("config", "config_opt"):
                value = ctx.params.get(key)
                if value is not None and str(value) not in WRITTEN_ON_THE_PAGE:
                    assert (REPO / value).is_file(), f"{page.name}: `{line}`: {value} does not exist"
            seen += 1
    assert seen >= 20  # the pages hold commands, and this found them


@pytest.mark.parametrize("page", ["README.md", "docs/index.md"])
def test_the_your_own_model_config_validates_as_written(page, tmp_path):
    """The landing page's config block is a whole config: written to a file and loaded, it validates."""
    text = (REPO / page).read_text()
    block = text.split("## Your own model", 1)[1].split("```yaml\n", 1)[1].split("```", 1)[0]
    (tmp_path / "my-model.yaml").write_text(block)
    cfg = load_config(tmp_path / "my-model.yaml")
    assert cfg.target.model == "/models/my-model" and cfg.prompts.sources[0].dataset == "sharegpt"
    assert [s.name for s in cfg.evaluate.sets] == ["mt_bench"]


def test_the_large_target_examples_expect_reasoning_only_from_a_target_that_thinks():
    """Kimi-K2.5 thinks before it answers; DeepSeek-V3 does not, and `expect_reasoning: true` would stop its
    generation after the first replies: each has its own example, the same target-side settings otherwise."""
    kimi, deepseek = (load_config(REPO / "examples" / f) for f in ("kimi-k2.5.yaml", "deepseek-v3.yaml"))
    assert kimi.generate.expect_reasoning and kimi.target.trust_remote_code
    assert not deepseek.generate.expect_reasoning and not deepseek.target.trust_remote_code
    assert deepseek.target.model == "deepseek-ai/DeepSeek-V3"
    assert deepseek.train.online_from == kimi.train.online_from and deepseek.train.parallel == "fsdp"
