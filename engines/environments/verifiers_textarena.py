"""TextArena word games through verifiers' own TextArena environment, offline.

`load_environment` is a factory for the `verifiers` plugin (engines/environments/verifiers_env.py):

    [[envs]]
    id = "verifiers"
    args = { env = "engines.environments.verifiers_textarena:load_environment",
             env_args = { game = "Hangman-v0", nltk_data = "data/nltk" } }

It builds verifiers 0.4.0's `TextArenaEnv` (verifiers.v1.tasksets.textarena: the `textarena` 0.7.4 game
engine plays the user, each model move is stepped host-side and the next observation comes back as the
user turn, the game's own reward is the episode's) with what rollflow runs it on: verifiers' shipped
`null` harness (its chat program, which streams; verifiers_client.py and verifiers_programs.py make it run
offline), the host subprocess runtime, one in-process interception server, and the first `num_tasks`
seeded games (TextArena's taskset is infinite).

TextArena's word games read NLTK's `words` corpus (Wordle also NLTK's `averaged_perceptron_tagger_eng`),
which `nltk.download` fetches from the network. Offline the data must already be on disk: `nltk_data`
(or `$NLTK_DATA`, or NLTK's default folders) is checked at load and a missing resource is refused naming
the game, the resource and how to supply it. `python -m engines.environments.verifiers_textarena words DIR`
writes a stand-in `words` corpus from the English dictionaries textarena itself bundles. Once the data is
found, NLTK's downloader is pointed at a local index, so the `nltk.download` calls in textarena and
verifiers (on every import and taskset load) never leave the machine.
"""

from __future__ import annotations

import contextlib
import importlib.resources
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from engines.registry import PluginError
from storage.fs import write_text_atomic

# What each game of verifiers' TextArenaConfig reads from NLTK's data (`nltk.data.find` paths).
GAME_DATA = {
    "Hangman-v0": ["corpora/words"],
    "WordSearch-v0": ["corpora/words"],
    "WordLadder-v0": ["corpora/words"],
    "Wordle-v0": ["corpora/words", "taggers/averaged_perceptron_tagger_eng"],
    "Wordle-v0-long": ["corpora/words", "taggers/averaged_perceptron_tagger_eng"],
}
BASIC_LENGTHS = (3, 5)  # the stand-in `en-basic`: common-dictionary words of 3-5 letters


def _dictionary(name: str) -> list[str]:
    """The words of one of textarena's bundled hunspell dictionaries (its first line is the count)."""
    text = importlib.resources.files("textarena.envs.utils.data").joinpath(name).read_text()
    return [line.split("/")[0].strip() for line in text.splitlines()[1:] if line.strip()]


def write_words_corpus(root: str | Path) -> Path:
    """A stand-in for NLTK's `words` corpus under `root` (an NLTK data folder), from textarena's bundled
    en_US and en_GB dictionaries: `en` every alphabetic entry of either, `en-basic` the lowercase words of
    3-5 letters in both (NLTK's own `en-basic` is Basic English's 850 words, so games draw from a wider
    list). Returns the corpus folder."""
    us, gb = _dictionary("en_US.dic"), _dictionary("en_GB.dic")
    every = sorted({w for w in us + gb if w.isalpha()})
    lo, hi = BASIC_LENGTHS
    basic = sorted({w for w in us if w.isalpha() and w.islower() and lo <= len(w) <= hi} & set(gb))
    corpus = Path(root) / "corpora" / "words"
    write_text_atomic(corpus / "en", "\n".join(every) + "\n")
    write_text_atomic(corpus / "en-basic", "\n".join(basic) + "\n")
    write_text_atomic(corpus / "README", "Stand-in written by rollflow from textarena's bundled dictionaries.\n")
    return corpus


@contextlib.contextmanager
def _torch_entry_lifted() -> Iterator[None]:
    """Import scientific modules under the orchestrator's `forbid_torch` (engines/orchestrator/loop.py).
    nltk imports scipy.stats, whose import-time docstring examples ask scipy's array-API helper whether a
    value is a torch tensor; it looks `torch` up in sys.modules and fails on the None that hides torch.
    Lifted for the import only: neither nltk nor scipy imports torch, and the entry is back afterwards."""
    hidden = "torch" in sys.modules and sys.modules["torch"] is None
    if hidden:
        del sys.modules["torch"]
    try:
        yield
    finally:
        if hidden:
            sys.modules.setdefault("torch", None)  # type: ignore[arg-type]


def _import_nltk() -> Any:
    with _torch_entry_lifted():
        import nltk

    return nltk


def _missing(resources: list[str]) -> list[str]:
    nltk = _import_nltk()

    missing = []
    for resource in resources:
        try:
            nltk.data.find(resource)
        except LookupError:
            missing.append(resource)
    return missing


def check_data(game: str, nltk_data: str | None) -> None:
    """Refuse `game` when NLTK data it reads is not on disk, naming what and how to supply it."""
    nltk = _import_nltk()

    if game not in GAME_DATA:
        raise PluginError(f"TextArena game {game!r} is not one verifiers' TextArenaEnv plays; valid: {list(GAME_DATA)}")
    if nltk_data is not None:
        if not Path(nltk_data).is_dir():
            raise PluginError(f"TextArena {game}: nltk_data {nltk_data!r} is not a directory")
        if nltk_data not in nltk.data.path:
            nltk.data.path.insert(0, nltk_data)
    missing = _missing(GAME_DATA[game])
    if missing:
        ids = " ".join(m.split("/")[1] for m in missing)
        stand_in = (
            "write a stand-in words corpus with `python -m engines.environments.verifiers_textarena words DIR`, or "
            if missing == ["corpora/words"]
            else ""
        )
        raise PluginError(
            f"TextArena {game} needs NLTK data that is not on this machine: {', '.join(missing)} "
            f"(searched {nltk.data.path}); nltk.download cannot fetch it offline: {stand_in}copy NLTK's own data "
            f"from a machine with network (`python -m nltk.downloader -d DIR {ids}`), then set "
            "env_args.nltk_data = DIR (or $NLTK_DATA)"
        )


def _downloader_offline(nltk_data: str | None) -> None:
    """Point NLTK's downloader at a local index (absent: every lookup fails at once), so the
    `nltk.download(...)` calls textarena and verifiers make on import and load stay on this machine."""
    import nltk.downloader

    folder = Path(nltk_data or tempfile.gettempdir())
    nltk.downloader._downloader._url = (folder / "rollflow-no-index.xml").resolve().as_uri()


def load_environment(
    game: str = "Hangman-v0",
    num_tasks: int = 64,
    nltk_data: str | None = None,
    harness: str = "null",
    max_turns: int = 8,
) -> Any:
    """verifiers' TextArenaEnv on `game`'s first `num_tasks` seeded boards, played by verifiers' shipped
    `harness` (`null` or `bash`) in the host subprocess runtime, at most `max_turns` model turns a game."""
    if num_tasks < 1 or max_turns < 1:
        raise PluginError(f"TextArena {game}: num_tasks and max_turns must be >= 1, got {num_tasks}, {max_turns}")
    if harness not in ("null", "bash"):
        raise PluginError(f"TextArena {game}: harness {harness!r} is not one of verifiers' chat harnesses: null, bash")
    check_data(game, nltk_data)
    _downloader_offline(nltk_data)
    import verifiers.v1 as vf
    from verifiers.v1.interception.server import InterceptionServerConfig
    from verifiers.v1.runtimes.subprocess import SubprocessConfig
    from verifiers.v1.tasksets.textarena import TextArenaConfig, TextArenaEnv, TextArenaEnvConfig

    config = TextArenaEnvConfig(
        taskset=TextArenaConfig(id="textarena", game=game),
        player=vf.AgentConfig(harness={"id": harness}, runtime=SubprocessConfig(), max_turns=max_turns),
        interception=InterceptionServerConfig(),
    )
    env = TextArenaEnv(config)
    env.taskset = env.taskset.take(num_tasks)  # the taskset is infinite: a bounded view of its first games
    return env


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] != "words":
        print("usage: python -m engines.environments.verifiers_textarena words DIR", file=sys.stderr)
        return 2
    corpus = write_words_corpus(argv[1])
    print(f"wrote NLTK words corpus stand-in to {corpus}; use env_args.nltk_data = {argv[1]!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
