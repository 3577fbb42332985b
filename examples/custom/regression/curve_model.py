"""A model entry point for regression: called with `args` plus input_shape and output_shape.

A regression factory receives `output_shape`, the shape of one sample's
target ((1,) for one value per sample), and returns a module mapping
(N, *input_shape) to (N, *output_shape). (A classification factory receives
`num_classes` instead.)
"""

import math

from torch import nn


def smooth_mlp(input_shape, output_shape, hidden: int = 64, layers: int = 2):
    """An MLP with tanh activations: smooth functions fit smooth targets well."""
    width = math.prod(input_shape)
    modules = [nn.Flatten()]
    for _ in range(layers):
        modules += [nn.Linear(width, hidden), nn.Tanh()]
        width = hidden
    modules += [nn.Linear(width, math.prod(output_shape)), nn.Unflatten(1, tuple(output_shape))]
    return nn.Sequential(*modules)
