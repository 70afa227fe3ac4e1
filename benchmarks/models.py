"""In-repo model zoo for reprop's benchmarks, built from torch.nn only.

The benchmarks need realistic *parameter lists* (how many tensors, of which
shapes) and sometimes realistic forward/backward passes, without depending on
torchvision (absent on some machines, and tied to a torch version). Each model
here reproduces a well-known architecture exactly, down to the order and
names of its parameters, so results compare with published figures and with
runs that do use torchvision.

Adding a model: write a builder returning an ``nn.Module`` and register it in
``MODELS`` with its expected parameter-tensor and parameter counts;
``self_check()`` then verifies it along with the others.

    python benchmarks/models.py    # builds every registered model and checks its counts
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

# ---------------------------------------------------------------------------
# Shared building blocks
# ---------------------------------------------------------------------------


def make_divisible(v: float, divisor: int = 8, min_value: int | None = None) -> int:
    """Round a channel count to a multiple of ``divisor`` (torchvision's ``_make_divisible``).

    Never rounds down by more than 10%, so width multipliers < 1 keep their capacity.
    """
    if min_value is None:
        min_value = divisor
    new_v = max(min_value, int(v + divisor / 2) // divisor * divisor)
    if new_v < 0.9 * v:
        new_v += divisor
    return new_v


class ConvBNAct(nn.Sequential):
    """Conv2d (no bias) -> BatchNorm2d -> activation, with "same" padding.

    A Sequential (as torchvision's ``Conv2dNormActivation``) so that parameter
    names come out as ``<prefix>.0.weight``, ``<prefix>.1.weight``, ``<prefix>.1.bias``.
    """

    def __init__(self, in_ch: int, out_ch: int, kernel_size: int = 3, stride: int = 1,
                 groups: int = 1, activation: Callable[[], nn.Module] | None = nn.ReLU6):
        padding = (kernel_size - 1) // 2
        layers: list[nn.Module] = [
            nn.Conv2d(in_ch, out_ch, kernel_size, stride, padding, groups=groups, bias=False),
            nn.BatchNorm2d(out_ch),
        ]
        if activation is not None:
            layers.append(activation())
        super().__init__(*layers)


def init_like_torchvision(model: nn.Module) -> None:
    """Initialise weights as torchvision's classification models do.

    Conv: Kaiming normal (fan_out); BatchNorm: weight 1, bias 0;
    Linear: normal(0, 0.01), bias 0.
    """
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out")
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, 0, 0.01)
            nn.init.zeros_(m.bias)


# ---------------------------------------------------------------------------
# MobileNetV2 (Sandler et al. 2018), torchvision's variant
# ---------------------------------------------------------------------------


class InvertedResidual(nn.Module):
    """MobileNetV2 block: 1x1 expand -> 3x3 depthwise -> 1x1 linear projection.

    x is (B, inp, H, W) -> (B, oup, H/stride, W/stride); a residual connection
    when the shape is kept. The expansion conv is omitted when expand_ratio is 1.
    """

    def __init__(self, inp: int, oup: int, stride: int, expand_ratio: int):
        super().__init__()
        hidden = int(round(inp * expand_ratio))
        self.use_res_connect = stride == 1 and inp == oup
        layers: list[nn.Module] = []
        if expand_ratio != 1:
            layers.append(ConvBNAct(inp, hidden, kernel_size=1))
        layers += [
            ConvBNAct(hidden, hidden, stride=stride, groups=hidden),
            nn.Conv2d(hidden, oup, 1, 1, 0, bias=False),
            nn.BatchNorm2d(oup),
        ]
        self.conv = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv(x) if self.use_res_connect else self.conv(x)


# (expand ratio t, output channels c, repeats n, first stride s), from the paper's Table 2.
MOBILENET_V2_SETTING = [
    (1, 16, 1, 1),
    (6, 24, 2, 2),
    (6, 32, 3, 2),
    (6, 64, 4, 2),
    (6, 96, 3, 1),
    (6, 160, 3, 2),
    (6, 320, 1, 1),
]


class MobileNetV2(nn.Module):
    """torchvision.models.mobilenet_v2 with the same module tree and parameter names.

    Input (B, 3, H, W) float images, output (B, num_classes) logits.
    Width 1.0, 1000 classes: 158 parameter tensors, 3,504,872 parameters.
    """

    def __init__(self, num_classes: int = 1000, width_mult: float = 1.0,
                 dropout: float = 0.2, round_nearest: int = 8):
        super().__init__()
        in_ch = make_divisible(32 * width_mult, round_nearest)
        last_ch = make_divisible(1280 * max(1.0, width_mult), round_nearest)
        features: list[nn.Module] = [ConvBNAct(3, in_ch, stride=2)]
        for t, c, n, s in MOBILENET_V2_SETTING:
            out_ch = make_divisible(c * width_mult, round_nearest)
            for i in range(n):
                features.append(InvertedResidual(in_ch, out_ch, s if i == 0 else 1, t))
                in_ch = out_ch
        features.append(ConvBNAct(in_ch, last_ch, kernel_size=1))
        self.features = nn.Sequential(*features)
        self.classifier = nn.Sequential(nn.Dropout(p=dropout), nn.Linear(last_ch, num_classes))
        init_like_torchvision(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x)
        x = nn.functional.adaptive_avg_pool2d(x, (1, 1))
        return self.classifier(torch.flatten(x, 1))


# ---------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelSpec:
    """A registered model: how to build it and the counts it must have."""

    build: Callable[[], nn.Module]
    num_tensors: int  # len(list(model.parameters()))
    num_params: int   # sum(p.numel() for p in model.parameters())
    # A small batch-of-one input for a smoke-test forward pass (cheap, not the
    # benchmark resolution): images for CNNs, token ids for encoders, etc.
    example_input: Callable[[], torch.Tensor]


MODELS: dict[str, ModelSpec] = {
    "mobilenet_v2": ModelSpec(MobileNetV2, 158, 3_504_872, lambda: torch.zeros(1, 3, 64, 64)),
}


def build(name: str) -> nn.Module:
    """Build a registered model by name (see ``MODELS``) on the CPU, in float32."""
    try:
        spec = MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}") from None
    return spec.build()


def param_counts(model: nn.Module) -> tuple[int, int]:
    """(number of parameter tensors, total number of parameters) of a model."""
    params = list(model.parameters())
    return len(params), sum(p.numel() for p in params)


def self_check(names: list[str] | None = None) -> None:
    """Build each model (all registered ones by default) and assert its counts.

    Also runs a forward pass on the spec's small example input, so a block
    wired with the wrong channel counts fails here rather than in a benchmark.
    """
    for name in names or sorted(MODELS):
        spec = MODELS[name]
        model = build(name).eval()
        got = param_counts(model)
        want = (spec.num_tensors, spec.num_params)
        assert got == want, f"{name}: (tensors, params) = {got}, expected {want}"
        with torch.no_grad():
            model(spec.example_input())


if __name__ == "__main__":
    self_check()
    for name, spec in sorted(MODELS.items()):
        print(f"{name}: {spec.num_tensors} tensors, {spec.num_params:,} parameters: ok")
