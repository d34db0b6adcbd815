"""An OpenEnv environment written against openenv-core's public API (no network), for rollflow's tests: a copy
game of `rounds` rounds. `reset(seed)` shows `say:WORD`; each step scores the model's message against WORD
(difflib ratio divided by `rounds`, so an episode's rewards sum to at most 1) and shows the next word, or ends
the episode after the last round. Words are 2-4 lowercase letters, drawn from the reset seed.

Served the way OpenEnv environments are: `uvicorn oe_echo:app` (rollflow starts it itself,
`[[envs]] id = "openenv"`, `args = { app = "oe_echo:app" }`).
"""

from __future__ import annotations

import random
import string
from difflib import SequenceMatcher
from typing import Any

from openenv.core.env_server import Action, Environment, Observation, State, create_app

PREFIX = "say:"


class EchoAction(Action):
    message: str


class EchoObservation(Observation):
    prompt: str = ""


class EchoGame(Environment[EchoAction, EchoObservation, State]):
    SUPPORTS_CONCURRENT_SESSIONS = True  # each WebSocket session gets its own instance; nothing is shared

    def __init__(self) -> None:
        super().__init__()
        self._state = State()
        self._words: list[str] = []

    def reset(self, seed: int | None = None, episode_id: str | None = None, rounds: int = 2, **_: Any):
        rng = random.Random(seed)
        self._words = [
            "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 4))) for _ in range(rounds)
        ]
        self._state = State(episode_id=episode_id, step_count=0)
        return EchoObservation(prompt=PREFIX + self._words[0])

    def step(self, action: EchoAction, timeout_s: float | None = None, **_: Any) -> EchoObservation:
        turn = self._state.step_count
        self._state.step_count += 1
        reward = SequenceMatcher(None, action.message, self._words[turn]).ratio() / len(self._words)
        done = self._state.step_count == len(self._words)
        prompt = "" if done else PREFIX + self._words[self._state.step_count]
        return EchoObservation(prompt=prompt, reward=reward, done=done)

    @property
    def state(self) -> State:
        return self._state


app = create_app(EchoGame, EchoAction, EchoObservation, env_name="oe_echo", max_concurrent_envs=64)
