"""`count-shapes`: the toy visual task of the tiny vision-language model (docs/models.md "Images").

Each image is 64 x 64 pixels, four 32 x 32 quadrants; a quadrant holds one filled square or nothing. The
model's vision encoder cuts it into 16-pixel patches and merges 2 x 2 of them, so each quadrant becomes one
image token (engines/models/vision.py). The prompt is `count` and the answer the number of squares as one
digit, over all of the task's `images` (1 by default; 2 makes the multi-image variant whose mismatch the
trainer reports per image count).

    rng -> per image: how many squares (uniform 0..4, so no answer dominates) -> which quadrants -> per square
           a size, a position inside its quadrant and a colour, on a dark background of its own colour
        -> PNG bytes (PIL, deterministic for the same draws) -> Task(prompt "count", answer "<n>", images)

Reward: 1 for the exact count, else partial credit max(0, 1 - |guess - n| / credit) (0 for no digit; `credit` 2
by default: off by one earns 0.5), so a policy that is off by one still earns more than one that is far off and
RL has a gradient before the answers are exact. Measured with the tiny Qwen3-VL (engines/models/tiny_vlm.py,
frozen encoder, AdamW 3e-3, 32 tasks a step, supervised on the answer): held-out exact 0.27 after 50 steps,
0.65 after 200, 0.80 after 250 (one image); two images 0.17, 0.30, 0.49 after 50, 200, 300 steps: a short
warm-up leaves room for RL.
Held-out split: a task whose images hash (CRC-32 of the PNG bytes) into bucket 0 of EVAL_BUCKETS is held out;
`sample` redraws those, `eval_task(i)` draws only them, as the string tasks do (engines/environments/base.py).
"""

from __future__ import annotations

import io
import random
import zlib
from dataclasses import dataclass

from engines.environments.base import EVAL_BUCKETS, MAX_DRAWS, Environment, Task

SIDE = 64  # pixels of an image's side
QUADRANT = SIDE // 2  # one image token's pixels (patch 16, merge 2)
MAX_IMAGES = 2  # the digit answer holds at most 4 * 2 = 8 squares
PROMPT = "count"


@dataclass(frozen=True)
class Square:
    quadrant: int  # 0..3, row-major
    x: int  # top-left corner, pixels
    y: int
    size: int
    color: tuple[int, int, int]


def _square(rng: random.Random, quadrant: int, min_size: int, max_size: int) -> Square:
    size = rng.randint(min_size, max_size)
    qx, qy = (quadrant % 2) * QUADRANT, (quadrant // 2) * QUADRANT
    x = qx + rng.randint(1, QUADRANT - size - 1)  # a pixel of background around it: squares never touch
    y = qy + rng.randint(1, QUADRANT - size - 1)
    bright = rng.randrange(3)  # one channel bright, the others anything: contrast with the dark background
    color = tuple(rng.randint(160, 255) if c == bright else rng.randint(0, 255) for c in range(3))
    return Square(quadrant, x, y, size, color)  # type: ignore[arg-type]


def draw_squares(rng: random.Random, min_size: int, max_size: int) -> list[Square]:
    n = rng.randint(0, 4)
    return [_square(rng, q, min_size, max_size) for q in sorted(rng.sample(range(4), n))]


def render(squares: list[Square], background: tuple[int, int, int]) -> bytes:
    """The PNG bytes of one image (no timestamps or other metadata: the same squares give the same bytes)."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (SIDE, SIDE), background)
    pen = ImageDraw.Draw(img)
    for s in squares:
        pen.rectangle((s.x, s.y, s.x + s.size - 1, s.y + s.size - 1), fill=s.color)
    out = io.BytesIO()
    img.save(out, format="PNG", optimize=False)
    return out.getvalue()


@dataclass
class CountShapes:
    name: str = "count-shapes"
    images: int = 1
    min_size: int = 8
    max_size: int = 20
    eval_size: int = 200
    credit: int = 2

    def _draw(self, rng: random.Random) -> Task:
        pngs, total = [], 0
        for _ in range(self.images):
            squares = draw_squares(rng, self.min_size, self.max_size)
            background = (rng.randint(0, 60), rng.randint(0, 60), rng.randint(0, 60))
            pngs.append(render(squares, background))
            total += len(squares)
        return Task(self.name, PROMPT, str(total), images=tuple(pngs))

    def _split_task(self, rng: random.Random, held_out: bool) -> Task:
        for _ in range(MAX_DRAWS):
            task = self._draw(rng)
            if (zlib.crc32(b"".join(task.images)) % EVAL_BUCKETS == 0) == held_out:
                return task
        raise ValueError(f"{self.name}: no {'held-out' if held_out else 'training'} task in {MAX_DRAWS} draws")

    def sample(self, rng: random.Random) -> Task:
        return self._split_task(rng, held_out=False)

    def eval_task(self, index: int) -> Task:
        return self._split_task(random.Random(f"{self.name}/{self.images}/eval/{index}"), held_out=True)

    def reward(self, task: Task, completion: str) -> float:
        text = completion.strip()
        if not text.isdigit():
            return 0.0
        miss = abs(int(text) - int(task.answer))
        return max(0.0, 1.0 - miss / self.credit)


def count_shapes(
    images: int = 1,
    min_size: int = 8,
    max_size: int = 20,
    eval_size: int = 200,
    credit: int = 2,
    prompt_style: str = "tag",
) -> Environment:
    """The `count-shapes` plugin: count the filled squares in `images` 64 x 64 images (1 or 2), squares of
    `min_size`..`max_size` pixels; `eval_size` held-out tasks; a guess `credit` or more off earns 0, closer ones
    partial credit. The prompt is `count` in either prompt style."""
    if not (isinstance(images, int) and 1 <= images <= MAX_IMAGES):
        raise ValueError(f"images={images!r}; need 1..{MAX_IMAGES} (the answer is one digit)")
    if not (isinstance(min_size, int) and isinstance(max_size, int) and 2 <= min_size <= max_size <= QUADRANT - 2):
        raise ValueError(f"need integers 2 <= min_size <= max_size <= {QUADRANT - 2}, got {min_size}, {max_size}")
    if not (isinstance(eval_size, int) and eval_size > 0):
        raise ValueError(f"eval_size={eval_size!r}; need a positive integer (the held-out tasks)")
    if not (isinstance(credit, int) and credit >= 1):
        raise ValueError(f"credit={credit!r}; need an integer >= 1 (1: exact answers only)")
    del prompt_style  # one prompt for both styles: the char vocabulary spells `count` either way
    return CountShapes("count-shapes", images, min_size, max_size, eval_size, credit)
