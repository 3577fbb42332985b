"""A dataset entry point: a seeded synthetic regression problem, no downloads.

y = sin(pi * x0) + x1 * x2 + 0.5 * x3^2 + noise, for x drawn uniformly from
[-1, 1]^features (features beyond the fourth are distractors). Returns (x, y)
with y of shape (samples,): one real target per sample. kubetrain takes a 1-D
y as (samples, 1), so the model outputs one value per sample.
"""

import numpy as np


def curve(samples: int = 4096, features: int = 6, noise: float = 0.1, seed: int = 0):
    if samples < 1 or features < 4 or noise < 0:
        raise ValueError(f"need samples >= 1, features >= 4, noise >= 0; got {samples}, {features}, {noise}")
    rng = np.random.default_rng(seed)
    x = rng.uniform(-1.0, 1.0, (samples, features))
    y = np.sin(np.pi * x[:, 0]) + x[:, 1] * x[:, 2] + 0.5 * x[:, 3] ** 2 + rng.normal(0.0, noise, samples)
    return x.astype(np.float32), y.astype(np.float32)
