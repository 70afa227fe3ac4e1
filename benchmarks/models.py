"""In-repo model zoo for reprop's benchmarks, built from torch.nn only.

The benchmarks need realistic *parameter lists* (how many tensors, of which
shapes) and sometimes realistic forward/backward passes, without depending on
torchvision (absent on some machines, and tied to a torch version). Each model
here reproduces a well-known architecture exactly, down to the order and
names of its parameters, so results compare with published figures and with
runs that do use torchvision.

Models (name in ``MODELS``: input -> output):

  * ``mobilenet_v2``, ``mobilenet_v3_large``, ``resnet18``, ``resnet50``,
    ``densenet121``, ``vgg19_bn``: images (B, 3, H, W) -> (B, 1000) logits,
    torchvision's architectures;
  * ``mobilenet_v3_large_0.25`` / ``_0.5`` / ``_0.75`` (torchvision's
    ``mobilenet_v3_large(width_mult=...)``) and ``densenet121_k12`` / ``_k24``
    (DenseNet-121 with growth rate 12 or 24): the same, at other sizes;
  * ``transformer_base``: token ids (B, L) -> (B, L, 30522) logits, a
    BERT-base-sized encoder with a masked-LM head tied to the input embedding;
  * ``bert_base``: token ids (B, L) -> (B, 2) logits, BERT-base for sequence
    classification from explicit modules in HuggingFace's layout.

``resnet50(act=...)`` and ``bert_base(act=..., layers=...)`` take an
activation-module factory; ``activation(name, variant)`` gives one for Swish,
Mish, GELU and tanh-GELU as torch's native module, the formula written out
with torch ops ("composed"), or the composed form under
torch.utils.checkpoint ("checkpointed") (the FAD benchmark's candidates).

``make_batch(name, batch_size, ...)`` returns synthetic (inputs, labels) of the
right kind for a model; ``cross_entropy(logits, labels)`` is a loss for either.

Adding a model: write a builder returning an ``nn.Module`` and register it in
``MODELS`` with its expected parameter-tensor and parameter counts and its
input kind; ``self_check()`` then verifies it along with the others.

    python benchmarks/models.py    # builds every registered model and checks its counts,
                                   # and that every activation variant matches the native one
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

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
    ``norm(out_ch)`` builds the norm layer (MobileNetV3 passes its BatchNorm eps and momentum).
    """

    def __init__(self, in_ch: int, out_ch: int, kernel_size: int = 3, stride: int = 1,
                 groups: int = 1, activation: Callable[[], nn.Module] | None = nn.ReLU6,
                 norm: Callable[[int], nn.Module] = nn.BatchNorm2d):
        padding = (kernel_size - 1) // 2
        layers: list[nn.Module] = [
            nn.Conv2d(in_ch, out_ch, kernel_size, stride, padding, groups=groups, bias=False),
            norm(out_ch),
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
# MobileNetV3-Large (Howard et al. 2019), torchvision's variant
# ---------------------------------------------------------------------------

# torchvision's MobileNetV3 norm layer: BatchNorm2d with eps 0.001 and momentum 0.01.
MOBILENET_V3_NORM = partial(nn.BatchNorm2d, eps=0.001, momentum=0.01)


def hardswish_inplace() -> nn.Module:
    """The Hardswish of MobileNetV3's conv blocks and classifier (in place, as torchvision's)."""
    return nn.Hardswish(inplace=True)


class SqueezeExcitation(nn.Module):
    """torchvision.ops.SqueezeExcitation as MobileNetV3 uses it (ReLU, then Hardsigmoid scale).

    x is (B, ch, H, W) -> x * hardsigmoid(fc2(relu(fc1(avgpool(x))))), the same
    shape: fc1 and fc2 are 1x1 convs with bias, ch -> squeeze_ch -> ch, on the
    (B, ch, 1, 1) channel means, so each channel of x is scaled by a value in [0, 1].
    """

    def __init__(self, ch: int, squeeze_ch: int):
        super().__init__()
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Conv2d(ch, squeeze_ch, 1)
        self.fc2 = nn.Conv2d(squeeze_ch, ch, 1)
        self.activation = nn.ReLU()
        self.scale_activation = nn.Hardsigmoid()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.fc2(self.activation(self.fc1(self.avgpool(x))))
        return self.scale_activation(scale) * x


class InvertedResidualSE(nn.Module):
    """MobileNetV3 block (torchvision's mobilenetv3.InvertedResidual), channels already width-adjusted.

    x is (B, inp, H, W) -> (B, oup, H/stride, W/stride): 1x1 expand to ``hidden``
    (omitted when hidden == inp) -> kxk depthwise (stride here) -> squeeze-excitation
    (if ``use_se``; squeeze channels make_divisible(hidden // 4)) -> 1x1 linear
    projection; Hardswish (``use_hs``) or ReLU after the expand and depthwise convs;
    a residual connection when the shape is kept. All under ``block``, a Sequential,
    as torchvision names them (``block.0.0.weight``, ..., ``block.2.fc1.weight``).
    """

    def __init__(self, inp: int, kernel_size: int, hidden: int, oup: int, use_se: bool,
                 use_hs: bool, stride: int):
        super().__init__()
        self.use_res_connect = stride == 1 and inp == oup
        act = hardswish_inplace if use_hs else relu_inplace
        layers: list[nn.Module] = []
        if hidden != inp:
            layers.append(ConvBNAct(inp, hidden, 1, activation=act, norm=MOBILENET_V3_NORM))
        layers.append(ConvBNAct(hidden, hidden, kernel_size, stride, groups=hidden, activation=act,
                                norm=MOBILENET_V3_NORM))
        if use_se:
            layers.append(SqueezeExcitation(hidden, make_divisible(hidden // 4, 8)))
        layers.append(ConvBNAct(hidden, oup, 1, activation=None, norm=MOBILENET_V3_NORM))
        self.block = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.block(x)
        if self.use_res_connect:
            out += x  # in place, as torchvision's (out is a fresh BatchNorm output)
        return out


# torchvision's "Large" table (the paper's Table 1), at width 1.0: (input channels, kernel,
# expanded channels, output channels, squeeze-excitation, activation (RE: ReLU, HS: Hardswish),
# stride). 15 blocks, between the stem conv (3 -> 16) and the last 1x1 conv (160 -> 960).
MOBILENET_V3_LARGE_SETTING = [
    (16, 3, 16, 16, False, "RE", 1),
    (16, 3, 64, 24, False, "RE", 2),
    (24, 3, 72, 24, False, "RE", 1),
    (24, 5, 72, 40, True, "RE", 2),
    (40, 5, 120, 40, True, "RE", 1),
    (40, 5, 120, 40, True, "RE", 1),
    (40, 3, 240, 80, False, "HS", 2),
    (80, 3, 200, 80, False, "HS", 1),
    (80, 3, 184, 80, False, "HS", 1),
    (80, 3, 184, 80, False, "HS", 1),
    (80, 3, 480, 112, True, "HS", 1),
    (112, 3, 672, 112, True, "HS", 1),
    (112, 5, 672, 160, True, "HS", 2),
    (160, 5, 960, 160, True, "HS", 1),
    (160, 5, 960, 160, True, "HS", 1),
]


class MobileNetV3(nn.Module):
    """torchvision.models.mobilenet_v3_large(width_mult=...), the same module tree and parameter names.

    Input (B, 3, H, W) float images, output (B, num_classes) logits.
    ``features``: stem ConvBNAct (3x3, stride 2, Hardswish), the 15 InvertedResidualSE
    blocks of MOBILENET_V3_LARGE_SETTING, a 1x1 ConvBNAct (Hardswish) to 6x the last
    block's channels; ``avgpool``; ``classifier``: Linear -> Hardswish -> Dropout ->
    Linear. Every channel count, the classifier's hidden 1280 included (torchvision's
    ``last_channel = adjust_channels(1280)``, unlike MobileNetV2's), is scaled by
    ``width_mult`` and rounded with make_divisible(., 8); the last conv's 6x is not rounded.
    Width 1.0, 1000 classes: 174 parameter tensors, 5,483,032 parameters; 960 -> 1280 -> 1000.
    """

    def __init__(self, width_mult: float = 1.0, num_classes: int = 1000, dropout: float = 0.2):
        super().__init__()

        def adjust_channels(ch: int) -> int:
            return make_divisible(ch * width_mult, 8)

        first_ch = adjust_channels(MOBILENET_V3_LARGE_SETTING[0][0])
        features: list[nn.Module] = [ConvBNAct(3, first_ch, 3, 2, activation=hardswish_inplace,
                                               norm=MOBILENET_V3_NORM)]
        for inp, k, hidden, oup, use_se, act, stride in MOBILENET_V3_LARGE_SETTING:
            features.append(InvertedResidualSE(adjust_channels(inp), k, adjust_channels(hidden),
                                               adjust_channels(oup), use_se, act == "HS", stride))
        last_conv_in = adjust_channels(MOBILENET_V3_LARGE_SETTING[-1][3])
        last_conv_out = 6 * last_conv_in
        features.append(ConvBNAct(last_conv_in, last_conv_out, 1, activation=hardswish_inplace,
                                  norm=MOBILENET_V3_NORM))
        last_ch = adjust_channels(1280)
        self.features = nn.Sequential(*features)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(
            nn.Linear(last_conv_out, last_ch), hardswish_inplace(),
            nn.Dropout(p=dropout, inplace=True), nn.Linear(last_ch, num_classes),
        )
        init_like_torchvision(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.avgpool(self.features(x))
        return self.classifier(torch.flatten(x, 1))


# ---------------------------------------------------------------------------
# ResNet (He et al. 2016), torchvision's variant (v1.5: stride on the 3x3 conv)
# ---------------------------------------------------------------------------


def conv3x3(in_ch: int, out_ch: int, stride: int = 1) -> nn.Conv2d:
    """3x3 convolution, padding 1, no bias (a BatchNorm follows)."""
    return nn.Conv2d(in_ch, out_ch, 3, stride, 1, bias=False)


def conv1x1(in_ch: int, out_ch: int, stride: int = 1) -> nn.Conv2d:
    """1x1 convolution, no bias (a BatchNorm follows)."""
    return nn.Conv2d(in_ch, out_ch, 1, stride, bias=False)


def relu_inplace() -> nn.Module:
    """torchvision's ResNet activation, the default ``act`` of the ResNet classes."""
    return nn.ReLU(inplace=True)


class BasicBlock(nn.Module):
    """ResNet-18/34 block: two 3x3 convs, residual (through ``downsample`` when the shape changes).

    ``act`` builds the block's activation module (one instance, applied twice,
    kept under torchvision's name ``relu`` whatever it is; it has no parameters).
    """

    expansion = 1

    def __init__(self, in_ch: int, ch: int, stride: int = 1, downsample: nn.Module | None = None,
                 act: Callable[[], nn.Module] = relu_inplace):
        super().__init__()
        self.conv1 = conv3x3(in_ch, ch, stride)
        self.bn1 = nn.BatchNorm2d(ch)
        self.relu = act()
        self.conv2 = conv3x3(ch, ch)
        self.bn2 = nn.BatchNorm2d(ch)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class Bottleneck(nn.Module):
    """ResNet-50+ block: 1x1 reduce -> 3x3 (strided) -> 1x1 expand (x4), residual.

    ``act`` as in BasicBlock (one instance named ``relu``, applied three times).
    """

    expansion = 4

    def __init__(self, in_ch: int, ch: int, stride: int = 1, downsample: nn.Module | None = None,
                 act: Callable[[], nn.Module] = relu_inplace):
        super().__init__()
        self.conv1 = conv1x1(in_ch, ch)
        self.bn1 = nn.BatchNorm2d(ch)
        self.conv2 = conv3x3(ch, ch, stride)
        self.bn2 = nn.BatchNorm2d(ch)
        self.conv3 = conv1x1(ch, ch * self.expansion)
        self.bn3 = nn.BatchNorm2d(ch * self.expansion)
        self.relu = act()
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class ResNet(nn.Module):
    """torchvision.models.ResNet with the same module tree and parameter names.

    Input (B, 3, H, W) images, output (B, num_classes) logits. ``block`` is
    BasicBlock or Bottleneck, ``layers`` the number of blocks in each of the
    four stages (ResNet-18: BasicBlock, [2, 2, 2, 2]; ResNet-50: Bottleneck, [3, 4, 6, 3]).
    ``act`` builds every activation module (the stem's and one per block;
    default ReLU(inplace=True), torchvision's); activations have no parameters,
    so the parameter names and counts do not depend on it.
    """

    def __init__(self, block: type[BasicBlock] | type[Bottleneck], layers: list[int],
                 num_classes: int = 1000, act: Callable[[], nn.Module] = relu_inplace):
        super().__init__()
        self.in_ch = 64
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = act()
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        self.layer1 = self._make_layer(block, 64, layers[0], 1, act)
        self.layer2 = self._make_layer(block, 128, layers[1], 2, act)
        self.layer3 = self._make_layer(block, 256, layers[2], 2, act)
        self.layer4 = self._make_layer(block, 512, layers[3], 2, act)
        self.fc = nn.Linear(512 * block.expansion, num_classes)
        init_like_torchvision(self)

    def _make_layer(self, block, ch: int, blocks: int, stride: int,
                    act: Callable[[], nn.Module]) -> nn.Sequential:
        """One stage; its first block changes the shape, through a 1x1 conv + BN shortcut if needed."""
        downsample = None
        if stride != 1 or self.in_ch != ch * block.expansion:
            downsample = nn.Sequential(conv1x1(self.in_ch, ch * block.expansion, stride),
                                       nn.BatchNorm2d(ch * block.expansion))
        layers = [block(self.in_ch, ch, stride, downsample, act)]
        self.in_ch = ch * block.expansion
        layers += [block(self.in_ch, ch, act=act) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        x = nn.functional.adaptive_avg_pool2d(x, (1, 1))
        return self.fc(torch.flatten(x, 1))


def resnet18() -> ResNet:
    """ResNet-18: 62 parameter tensors, 11,689,512 parameters."""
    return ResNet(BasicBlock, [2, 2, 2, 2])


def resnet50(act: Callable[[], nn.Module] = relu_inplace) -> ResNet:
    """ResNet-50: 161 parameter tensors, 25,557,032 parameters, whatever ``act`` builds.

    49 activation calls per forward: the stem's and three in each of the 16 Bottlenecks.
    """
    return ResNet(Bottleneck, [3, 4, 6, 3], act=act)


# ---------------------------------------------------------------------------
# DenseNet (Huang et al. 2017), torchvision's variant
# ---------------------------------------------------------------------------


class DenseLayer(nn.Module):
    """BN-ReLU-1x1 conv (to bn_size * growth) -> BN-ReLU-3x3 conv (to growth).

    Takes the list of all earlier feature maps of its block and returns only
    its ``growth`` new channels (torchvision's ``_DenseLayer``, without the
    memory-efficient checkpointing, which is off by default there too).
    """

    def __init__(self, in_ch: int, growth: int, bn_size: int):
        super().__init__()
        self.norm1 = nn.BatchNorm2d(in_ch)
        self.relu1 = nn.ReLU(inplace=True)
        self.conv1 = nn.Conv2d(in_ch, bn_size * growth, 1, 1, bias=False)
        self.norm2 = nn.BatchNorm2d(bn_size * growth)
        self.relu2 = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(bn_size * growth, growth, 3, 1, 1, bias=False)

    def forward(self, features: list[torch.Tensor]) -> torch.Tensor:
        x = self.conv1(self.relu1(self.norm1(torch.cat(features, 1))))
        return self.conv2(self.relu2(self.norm2(x)))


class DenseBlock(nn.ModuleDict):
    """``num_layers`` DenseLayers, each fed every earlier output; returns them all concatenated.

    A ModuleDict (as torchvision's ``_DenseBlock``) so names read ``denselayer1.norm1.weight``.
    """

    def __init__(self, num_layers: int, in_ch: int, growth: int, bn_size: int):
        super().__init__()
        for i in range(num_layers):
            self[f"denselayer{i + 1}"] = DenseLayer(in_ch + i * growth, growth, bn_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = [x]
        for layer in self.values():
            features.append(layer(features))
        return torch.cat(features, 1)


class Transition(nn.Sequential):
    """BN-ReLU-1x1 conv (halving the channels) -> 2x2 average pool, between dense blocks."""

    def __init__(self, in_ch: int, out_ch: int):
        super().__init__()
        self.norm = nn.BatchNorm2d(in_ch)
        self.relu = nn.ReLU(inplace=True)
        self.conv = nn.Conv2d(in_ch, out_ch, 1, 1, bias=False)
        self.pool = nn.AvgPool2d(2, 2)


class DenseNet(nn.Module):
    """torchvision.models.DenseNet with the same module tree and parameter names.

    Input (B, 3, H, W) images, output (B, num_classes) logits. DenseNet-121:
    growth 32, blocks (6, 12, 24, 16), 64 initial features, bottleneck width 4 x growth.
    """

    def __init__(self, growth: int = 32, block_config: tuple[int, ...] = (6, 12, 24, 16),
                 num_init_features: int = 64, bn_size: int = 4, num_classes: int = 1000):
        super().__init__()
        self.features = nn.Sequential()
        self.features.add_module("conv0", nn.Conv2d(3, num_init_features, 7, 2, 3, bias=False))
        self.features.add_module("norm0", nn.BatchNorm2d(num_init_features))
        self.features.add_module("relu0", nn.ReLU(inplace=True))
        self.features.add_module("pool0", nn.MaxPool2d(3, 2, 1))
        ch = num_init_features
        for i, num_layers in enumerate(block_config):
            self.features.add_module(f"denseblock{i + 1}", DenseBlock(num_layers, ch, growth, bn_size))
            ch += num_layers * growth
            if i != len(block_config) - 1:
                self.features.add_module(f"transition{i + 1}", Transition(ch, ch // 2))
                ch //= 2
        self.features.add_module("norm5", nn.BatchNorm2d(ch))
        self.classifier = nn.Linear(ch, num_classes)
        init_like_torchvision(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = nn.functional.relu(self.features(x))
        x = nn.functional.adaptive_avg_pool2d(x, (1, 1))
        return self.classifier(torch.flatten(x, 1))


def densenet121_growth(growth: int) -> DenseNet:
    """DenseNet-121 (blocks 6, 12, 24, 16; torchvision's 64 initial features, bottleneck
    4 x growth) with growth rate ``growth`` instead of 32: 364 parameter tensors whatever
    the growth; 1,448,376 parameters at 12, 4,743,180 at 24 (7,978,856 at 32).
    """
    return DenseNet(growth=growth)


# ---------------------------------------------------------------------------
# VGG (Simonyan & Zisserman 2015) with batch norm, torchvision's variant
# ---------------------------------------------------------------------------

# Configuration "E" (19 weight layers): output channels of each 3x3 conv, "M" a 2x2 max pool.
VGG19_CONFIG: list[int | str] = [64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M",
                                 512, 512, 512, 512, "M", 512, 512, 512, 512, "M"]


class VGG(nn.Module):
    """torchvision.models.vgg19_bn with the same module tree and parameter names.

    Input (B, 3, H, W) images (H, W >= 32), output (B, num_classes) logits.
    The convs keep their bias even before a BatchNorm, as torchvision's do.
    """

    def __init__(self, config: list[int | str] = VGG19_CONFIG, num_classes: int = 1000,
                 dropout: float = 0.5):
        super().__init__()
        layers: list[nn.Module] = []
        in_ch = 3
        for v in config:
            if v == "M":
                layers.append(nn.MaxPool2d(2, 2))
            else:
                layers += [nn.Conv2d(in_ch, v, 3, padding=1), nn.BatchNorm2d(v), nn.ReLU(inplace=True)]
                in_ch = v
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d((7, 7))
        self.classifier = nn.Sequential(
            nn.Linear(512 * 7 * 7, 4096), nn.ReLU(True), nn.Dropout(dropout),
            nn.Linear(4096, 4096), nn.ReLU(True), nn.Dropout(dropout),
            nn.Linear(4096, num_classes),
        )
        init_like_torchvision(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.avgpool(self.features(x))
        return self.classifier(torch.flatten(x, 1))


# ---------------------------------------------------------------------------
# Transformer-base encoder with a tied masked-LM head (BERT-base sizes)
# ---------------------------------------------------------------------------

BERT_VOCAB = 30522
BERT_MAX_POSITIONS = 512


class TransformerEncoderLM(nn.Module):
    """A BERT-base-sized encoder (Devlin et al. 2019) built from nn.TransformerEncoderLayer.

    Token ids (B, L) -> (B, L, vocab) logits. Embeddings: word + learned
    position + token type (all ids 0 here) -> LayerNorm -> dropout; 12 post-norm
    encoder layers (d_model 768, 12 heads, FFN 3072, GELU, dropout 0.1,
    LayerNorm eps 1e-12); masked-LM head: dense 768 -> GELU -> LayerNorm ->
    decoder whose weight *is* the word-embedding weight (tied; its own bias).

    154 parameter tensors (the tied weight counted once, as model.parameters()
    does): 5 embedding + 12 x 12 per layer (nn.MultiheadAttention packs Q, K, V
    into one in_proj weight and bias, where BERT has three of each) + 5 head.
    109,514,298 parameters: embeddings 23,837,184 (30522x768 + 512x768 + 2x768
    + LayerNorm 2x768), 12 layers x 7,087,872, head 622,650 (768x768 + 768,
    LayerNorm 2x768, decoder bias 30522); the same layout and sizes as BERT-base
    with a masked-LM head and no pooler.
    """

    def __init__(self, vocab: int = BERT_VOCAB, max_positions: int = BERT_MAX_POSITIONS,
                 d_model: int = 768, heads: int = 12, ffn: int = 3072, layers: int = 12,
                 dropout: float = 0.1, eps: float = 1e-12):
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab, d_model)
        self.position_embeddings = nn.Embedding(max_positions, d_model)
        self.token_type_embeddings = nn.Embedding(2, d_model)
        self.embedding_norm = nn.LayerNorm(d_model, eps=eps)
        self.dropout = nn.Dropout(dropout)
        layer = nn.TransformerEncoderLayer(d_model, heads, ffn, dropout, activation="gelu",
                                           layer_norm_eps=eps, batch_first=True)
        # enable_nested_tensor only matters for padded inference; off, it doesn't warn.
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head_dense = nn.Linear(d_model, d_model)
        self.head_norm = nn.LayerNorm(d_model, eps=eps)
        self.decoder = nn.Linear(d_model, vocab)
        self.decoder.weight = self.word_embeddings.weight  # tied: one tensor, two uses per step
        init_like_bert(self)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = (self.word_embeddings(ids) + self.position_embeddings(positions)
             + self.token_type_embeddings(torch.zeros_like(ids)))
        x = self.encoder(self.dropout(self.embedding_norm(x)))
        x = self.head_norm(nn.functional.gelu(self.head_dense(x)))
        return self.decoder(x)


def init_like_bert(model: nn.Module) -> None:
    """BERT's initialisation: Linear and Embedding weights normal(0, 0.02), biases 0, LayerNorm 1/0."""
    for m in model.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, 0, 0.02)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
        elif isinstance(m, nn.MultiheadAttention):  # its packed Q, K, V projection is a bare Parameter
            nn.init.normal_(m.in_proj_weight, 0, 0.02)
            nn.init.zeros_(m.in_proj_bias)


# ---------------------------------------------------------------------------
# BERT-base encoder for sequence classification, from explicit modules (HuggingFace's layout)
# ---------------------------------------------------------------------------

BERT_LABELS = 2  # a GLUE-style sentence(-pair) task, as in the FAD paper's BERT runs


class BertEmbeddings(nn.Module):
    """Word + learned position + token type (all ids 0 here) embeddings -> LayerNorm -> dropout.

    (B, L) ids -> (B, L, hidden).
    """

    def __init__(self, vocab: int, max_positions: int, hidden: int, dropout: float, eps: float):
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab, hidden)
        self.position_embeddings = nn.Embedding(max_positions, hidden)
        self.token_type_embeddings = nn.Embedding(2, hidden)
        self.LayerNorm = nn.LayerNorm(hidden, eps=eps)
        self.dropout = nn.Dropout(dropout)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = (self.word_embeddings(ids) + self.position_embeddings(positions)
             + self.token_type_embeddings(torch.zeros_like(ids)))
        return self.dropout(self.LayerNorm(x))


class BertSelfAttention(nn.Module):
    """Q, K, V projections and scaled dot-product attention over all positions (no mask).

    (B, L, hidden) -> (B, L, hidden) (heads concatenated). The attention itself
    is F.scaled_dot_product_attention with dropout on the probabilities, as
    HuggingFace's default "sdpa" BERT attention.
    """

    def __init__(self, hidden: int, heads: int, dropout: float):
        super().__init__()
        self.heads = heads
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)
        self.dropout_p = dropout

    def split_heads(self, x: torch.Tensor) -> torch.Tensor:
        """(B, L, hidden) -> (B, heads, L, hidden / heads)."""
        b, seq, hidden = x.shape
        return x.view(b, seq, self.heads, hidden // self.heads).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (self.split_heads(proj(x)) for proj in (self.query, self.key, self.value))
        out = nn.functional.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout_p if self.training else 0.0)
        return out.transpose(1, 2).flatten(2)


class BertResidualOutput(nn.Module):
    """Linear (in -> hidden) -> dropout -> LayerNorm(. + residual): BertSelfOutput and BertOutput."""

    def __init__(self, in_features: int, hidden: int, dropout: float, eps: float):
        super().__init__()
        self.dense = nn.Linear(in_features, hidden)
        self.dropout = nn.Dropout(dropout)
        self.LayerNorm = nn.LayerNorm(hidden, eps=eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dropout(self.dense(x)) + residual)


class BertAttention(nn.Module):
    """Self-attention then its output block: (B, L, hidden) -> (B, L, hidden)."""

    def __init__(self, hidden: int, heads: int, dropout: float, eps: float):
        super().__init__()
        self.self = BertSelfAttention(hidden, heads, dropout)
        self.output = BertResidualOutput(hidden, hidden, dropout, eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output(self.self(x), x)


class BertIntermediate(nn.Module):
    """Linear hidden -> intermediate, then the activation MODULE ``act`` builds: (B, L, intermediate)."""

    def __init__(self, hidden: int, intermediate: int, act: Callable[[], nn.Module]):
        super().__init__()
        self.dense = nn.Linear(hidden, intermediate)
        self.intermediate_act_fn = act()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.intermediate_act_fn(self.dense(x))


class BertLayer(nn.Module):
    """One post-norm encoder layer, HuggingFace's BertLayer: attention, intermediate, output.

    (B, L, hidden) -> (B, L, hidden); module names as HuggingFace's
    (``attention.self.query``, ``intermediate.dense``, ``output.LayerNorm``, ...).
    """

    def __init__(self, hidden: int, heads: int, intermediate: int, dropout: float, eps: float,
                 act: Callable[[], nn.Module]):
        super().__init__()
        self.attention = BertAttention(hidden, heads, dropout, eps)
        self.intermediate = BertIntermediate(hidden, intermediate, act)
        self.output = BertResidualOutput(intermediate, hidden, dropout, eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.attention(x)
        return self.output(self.intermediate(x), x)


class BertClassifier(nn.Module):
    """A BERT-base encoder with a pooler and a sequence-classification head (HuggingFace's layout).

    Token ids (B, L) -> (B, num_labels) logits. Embeddings (BertEmbeddings),
    ``layers`` BertLayers (hidden 768, 12 heads, intermediate 3072 with the
    activation ``act`` builds, default exact (erf) GELU as BERT's; dropout 0.1;
    LayerNorm eps 1e-12), pooler dense 768 -> 768 + tanh on the first token,
    dropout, classifier 768 -> num_labels. ``layers`` below 12 gives the small
    variants the benchmarks' --quick runs use.
    """

    def __init__(self, layers: int = 12, act: Callable[[], nn.Module] = nn.GELU,
                 num_labels: int = BERT_LABELS, vocab: int = BERT_VOCAB,
                 max_positions: int = BERT_MAX_POSITIONS, hidden: int = 768, heads: int = 12,
                 intermediate: int = 3072, dropout: float = 0.1, eps: float = 1e-12):
        super().__init__()
        self.embeddings = BertEmbeddings(vocab, max_positions, hidden, dropout, eps)
        self.encoder = nn.ModuleList(BertLayer(hidden, heads, intermediate, dropout, eps, act)
                                     for _ in range(layers))
        self.pooler = nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh())
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(hidden, num_labels)
        init_like_bert(self)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(ids)
        for layer in self.encoder:
            x = layer(x)
        return self.classifier(self.dropout(self.pooler(x[:, 0])))


def bert_base(act: Callable[[], nn.Module] = nn.GELU, layers: int = 12) -> BertClassifier:
    """BERT-base for sequence classification (2 labels): 201 parameter tensors, 109,483,778 parameters.

    Tensors: 5 embedding (3 tables, LayerNorm weight and bias) + 12 layers x 16
    (Q, K, V, attention output, intermediate and output Linears: 6 x 2; two
    LayerNorms: 2 x 2) + pooler 2 + classifier 2. Parameters: embeddings
    23,837,184 (30522x768 + 512x768 + 2x768 + 2x768); per layer 7,087,872
    (4 x (768x768 + 768) + (768x3072 + 3072) + (3072x768 + 768) + 2 x 2x768);
    pooler 590,592 (768x768 + 768); classifier 1,538 (768x2 + 2). The same
    as HuggingFace's BertForSequenceClassification of bert-base-uncased.
    12 activation calls per forward (one per layer; the pooler's tanh is not ``act``).
    """
    return BertClassifier(layers=layers, act=act)


# ---------------------------------------------------------------------------
# Activation variants (the FAD benchmark's candidates)
# ---------------------------------------------------------------------------


class ComposedSwish(nn.Module):
    """Swish/SiLU written out, ``x * torch.sigmoid(x)``: autograd saves x and sigmoid(x)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(x)


class ComposedMish(nn.Module):
    """Mish written out, ``x * tanh(softplus(x))``: autograd saves x and the tanh."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.tanh(nn.functional.softplus(x))


class ComposedGELUTanh(nn.Module):
    """The tanh GELU as HuggingFace writes it out (NewGELUActivation).

    Autograd saves x (for pow), the tanh, 0.5 * x and 1 + tanh: four tensors.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


class ComposedGELU(nn.Module):
    """The exact (erf) GELU written out, as HuggingFace's old ``gelu``.

    Autograd saves x / sqrt(2) (for erf), x * 0.5 and 1 + erf: three tensors.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))


class Checkpointed(nn.Module):
    """Runs ``inner`` under torch.utils.checkpoint (non-reentrant): saves only its input x,
    and recomputes ``inner`` in backward to get the gradient."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.inner, x, use_reentrant=False)


@dataclass(frozen=True)
class Activation:
    """One activation function in the two forms the benchmarks compare."""

    native: Callable[[], nn.Module]    # torch's fused module (saves one input-sized tensor)
    composed: Callable[[], nn.Module]  # the formula written out with torch ops


ACTIVATIONS: dict[str, Activation] = {
    "swish": Activation(nn.SiLU, ComposedSwish),
    "mish": Activation(nn.Mish, ComposedMish),
    "gelu": Activation(nn.GELU, ComposedGELU),
    "gelu_tanh": Activation(partial(nn.GELU, approximate="tanh"), ComposedGELUTanh),
}
VARIANTS = ("native", "composed", "checkpointed")


def activation(name: str, variant: str) -> Callable[[], nn.Module]:
    """A factory for activation ``name`` (key of ACTIVATIONS) in ``variant`` (one of VARIANTS).

    "checkpointed" wraps the composed form in Checkpointed.
    """
    try:
        act = ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"unknown activation {name!r}; known: {', '.join(ACTIVATIONS)}") from None
    if variant == "native":
        return act.native
    if variant == "composed":
        return act.composed
    if variant == "checkpointed":
        return lambda: Checkpointed(act.composed())
    raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")


def check_activations() -> None:
    """Every variant of every activation computes its native form's values and gradients."""
    x = torch.linspace(-8, 8, 1001, dtype=torch.float64, requires_grad=True)
    for name in ACTIVATIONS:
        ref = ACTIVATIONS[name].native()(x)
        (ref_grad,) = torch.autograd.grad(ref.sum(), x)
        for variant in VARIANTS[1:]:
            y = activation(name, variant)()(x)
            (grad,) = torch.autograd.grad(y.sum(), x)
            assert torch.allclose(y, ref, atol=1e-6) and torch.allclose(grad, ref_grad, atol=1e-6), \
                f"{name} {variant}: differs from the native module"


# ---------------------------------------------------------------------------
# Recurrent classifiers (the BPPSA benchmark's models, paper Sections 4.1 and 4.2)
# ---------------------------------------------------------------------------

BITSTREAM_CLASSES = 10  # bitstream task (paper Eq. 8): x_t ~ Bernoulli(0.05 + 0.1 c), c in 0..9
IRMAS_CLASSES = 11      # IRMAS's predominant-instrument classes
# MFCC feature shapes, frames F x coefficients C, of the paper's S, M and L sets (Table 3).
MFCC_SHAPES: dict[str, tuple[int, int]] = {"S": (259, 38), "M": (517, 24), "L": (1034, 12)}


class RecurrentClassifier(nn.Module):
    """A one-layer recurrent module over the sequence, then a Linear on its last hidden state.

    Inputs (T, B, input_size) floats, sequence first (nn.RNN's default layout)
    -> (B, num_classes) logits. The recurrent module is the attribute ``rnn``
    (an nn.RNN or nn.GRU, so reprop.bppsa.convert finds and swaps it in place);
    parameters, in order: rnn.weight_ih_l0, rnn.weight_hh_l0, rnn.bias_ih_l0,
    rnn.bias_hh_l0, head.weight, head.bias, initialized as torch does.
    """

    def __init__(self, cell: type[nn.RNNBase], input_size: int, hidden_size: int, num_classes: int):
        super().__init__()
        self.rnn = cell(input_size, hidden_size)
        self.head = nn.Linear(hidden_size, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, h_n = self.rnn(x)  # h_n is (1, B, hidden): the state after the last step
        return self.head(h_n[-1])


def bitstream_rnn(hidden_size: int = 20) -> RecurrentClassifier:
    """The paper's RNN (Section 4.1, Eq. 9): tanh nn.RNN(1, hidden) + Linear(hidden, 10).

    670 parameters at hidden 20 (20 + 400 + 20 + 20, head 200 + 10).
    """
    return RecurrentClassifier(nn.RNN, 1, hidden_size, BITSTREAM_CLASSES)


def mfcc_gru(coefficients: int, hidden_size: int = 20) -> RecurrentClassifier:
    """The paper's GRU (Section 4.2, Eq. 10): nn.GRU(C, hidden) + Linear(hidden, 11).

    3,831 parameters for C = 38 at hidden 20 (3x20x38 + 3x400 + 2x60, head 220 + 11).
    """
    return RecurrentClassifier(nn.GRU, coefficients, hidden_size, IRMAS_CLASSES)


def mfcc_batch(frames: int, coefficients: int, batch_size: int, device: torch.device | str = "cpu",
               seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic MFCC-shaped (inputs, labels) for mfcc_gru.

    (F, B, C) standard-normal float32 features (the paper normalizes every
    coefficient to zero mean and unit variance) and (B,) int64 labels in
    [0, IRMAS_CLASSES). Generated on the CPU, then moved: the same data on
    any device for a given seed.
    """
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(frames, batch_size, coefficients, generator=g)
    y = torch.randint(IRMAS_CLASSES, (batch_size,), generator=g)
    return x.to(device), y.to(device)


# ---------------------------------------------------------------------------
# Registry and synthetic batches
# ---------------------------------------------------------------------------

IMAGE, TOKENS, SENTENCES = "image", "tokens", "sentences"
NUM_CLASSES = 1000


@dataclass(frozen=True)
class ModelSpec:
    """A registered model: how to build it, the counts it must have, what it takes as input."""

    build: Callable[[], nn.Module]
    num_tensors: int  # len(list(model.parameters()))
    num_params: int   # sum(p.numel() for p in model.parameters())
    inputs: str       # IMAGE: (B, 3, H, W) floats -> (B, 1000); TOKENS: (B, L) ids -> (B, L, vocab);
                      # SENTENCES: (B, L) ids -> (B, BERT_LABELS)


# Parameter counts of the torchvision models are torchvision's documented num_params
# (its model pages); tensor counts follow from the module trees (e.g. ResNet-18: conv1 +
# bn1 = 3, 8 blocks x 6, 3 downsample shortcuts x 3, fc 2 = 62). transformer_base's and
# bert_base's are derived in their docstrings.
#
# MobileNetV3-Large, 174 tensors at every width: stem 3 (conv, BN weight and bias);
# 15 blocks x 6 (depthwise and projection ConvBNAct), + 3 for the 14 with an expand conv
# (all but the first), + 4 for the 8 with squeeze-excitation (fc1, fc2 with biases);
# last conv 3; classifier 4: 3 + 90 + 42 + 32 + 3 + 4 = 174. Its width-1.0 count is
# torchvision's documented 5,483,032; the 0.25 / 0.5 / 0.75 counts are NOT documented
# anywhere: derived here from the module tree (build the model and count), and checked
# against a hand sum over MOBILENET_V3_LARGE_SETTING with torchvision's rounding.
# DenseNet-121 at growth 12 / 24 likewise: derived (364 tensors as at 32; the
# parameters come from the channel counts), not documented.
MODELS: dict[str, ModelSpec] = {
    "mobilenet_v2": ModelSpec(MobileNetV2, 158, 3_504_872, IMAGE),
    "mobilenet_v3_large": ModelSpec(MobileNetV3, 174, 5_483_032, IMAGE),
    "mobilenet_v3_large_0.25": ModelSpec(partial(MobileNetV3, width_mult=0.25), 174, 617_000, IMAGE),
    "mobilenet_v3_large_0.5": ModelSpec(partial(MobileNetV3, width_mult=0.5), 174, 1_734_576, IMAGE),
    "mobilenet_v3_large_0.75": ModelSpec(partial(MobileNetV3, width_mult=0.75), 174, 3_377_576, IMAGE),
    "resnet18": ModelSpec(resnet18, 62, 11_689_512, IMAGE),
    "resnet50": ModelSpec(resnet50, 161, 25_557_032, IMAGE),
    "densenet121": ModelSpec(DenseNet, 364, 7_978_856, IMAGE),
    "densenet121_k12": ModelSpec(partial(densenet121_growth, 12), 364, 1_448_376, IMAGE),
    "densenet121_k24": ModelSpec(partial(densenet121_growth, 24), 364, 4_743_180, IMAGE),
    "vgg19_bn": ModelSpec(VGG, 70, 143_678_248, IMAGE),
    "transformer_base": ModelSpec(TransformerEncoderLM, 154, 109_514_298, TOKENS),
    "bert_base": ModelSpec(bert_base, 201, 109_483_778, SENTENCES),
}


def build(name: str) -> nn.Module:
    """Build a registered model by name (see ``MODELS``) on the CPU, in float32."""
    return spec_of(name).build()


def spec_of(name: str) -> ModelSpec:
    """The registered ModelSpec of ``name``; ValueError listing the known names otherwise."""
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}") from None


def make_batch(name: str, batch_size: int, device: torch.device | str = "cpu", image_size: int = 224,
               seq_len: int = 128, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic (inputs, labels) for one training step of model ``name``.

    Images: (B, 3, image_size, image_size) standard-normal floats and (B,)
    class ids in [0, 1000). Tokens: (B, seq_len) ids and (B, seq_len) target
    ids, both uniform over the vocabulary. Sentences: (B, seq_len) ids uniform
    over the vocabulary and (B,) labels in [0, BERT_LABELS). Deterministic
    for a given seed.
    """
    g = torch.Generator().manual_seed(seed)  # on the CPU, then moved: the same data on any device
    inputs = spec_of(name).inputs
    if inputs == IMAGE:
        x = torch.randn(batch_size, 3, image_size, image_size, generator=g)
        y = torch.randint(NUM_CLASSES, (batch_size,), generator=g)
    elif inputs == SENTENCES:
        x = torch.randint(BERT_VOCAB, (batch_size, seq_len), generator=g)
        y = torch.randint(BERT_LABELS, (batch_size,), generator=g)
    else:
        x = torch.randint(BERT_VOCAB, (batch_size, seq_len), generator=g)
        y = torch.randint(BERT_VOCAB, (batch_size, seq_len), generator=g)
    return x.to(device), y.to(device)


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy for (B, C) logits and (B,) labels, or (B, L, V) and (B, L) per token."""
    return nn.functional.cross_entropy(logits.flatten(0, -2), labels.flatten())


def param_counts(model: nn.Module) -> tuple[int, int]:
    """(number of parameter tensors, total number of parameters) of a model."""
    params = list(model.parameters())
    return len(params), sum(p.numel() for p in params)


def self_check(names: list[str] | None = None) -> None:
    """Build each model (all registered ones by default) and assert its counts.

    Also runs a forward pass on a small batch of one (64x64 image or 16
    tokens, not the benchmark size), so a block wired with the wrong channel
    counts fails here rather than in a benchmark.
    """
    for name in names or sorted(MODELS):
        spec = MODELS[name]
        model = build(name).eval()
        got = param_counts(model)
        want = (spec.num_tensors, spec.num_params)
        assert got == want, f"{name}: (tensors, params) = {got}, expected {want}"
        x, y = make_batch(name, 1, image_size=64, seq_len=16)
        with torch.no_grad():
            out = model(x)
        assert out.shape[:-1] == y.shape, f"{name}: output {tuple(out.shape)} for labels {tuple(y.shape)}"


if __name__ == "__main__":
    self_check()
    check_activations()
    print(f"activations {', '.join(ACTIVATIONS)}: {', '.join(VARIANTS)} agree: ok")
    for name, spec in sorted(MODELS.items()):
        print(f"{name}: {spec.num_tensors} tensors, {spec.num_params:,} parameters: ok")
