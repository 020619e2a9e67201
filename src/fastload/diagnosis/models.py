"""Real training steps for ``fastload doctor --model NAME``, built in plain torch.

The doctor asks how long a step of the user's kind of model takes, so that it can say
whether the GPU or the loader binds. torchvision would give the models, but it is often
missing or broken beside the installed torch build, so the architectures are written here
from their papers, laid out as torchvision's (ResNet v1.5, ViT-B/16) so the parameter
counts, and so the step's work, are the same: resnet18 11,689,512, resnet50 25,557,032,
vit_b16 86,567,656, vit_s16 22,050,664 (timm's vit_small_patch16_224; torchvision has none).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fastload.decode.params import IMAGENET_MEAN, IMAGENET_STD

# --- ResNet (He et al. 2015; the stride on the bottleneck's 3x3 conv, torchvision's v1.5) ---


class BasicBlock(nn.Module):
    """Two 3x3 convs and a shortcut: resnet18/34's block."""

    expansion = 1

    def __init__(self, in_channels: int, width: int, stride: int = 1) -> None:
        super().__init__()
        out_channels = width * self.expansion
        self.conv1 = nn.Conv2d(in_channels, width, 3, stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, out_channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = _shortcut(in_channels, out_channels, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        result: torch.Tensor = self.relu(out + identity)
        return result


class Bottleneck(nn.Module):
    """1x1 down, 3x3 (strided: v1.5, more accurate than striding the 1x1), 1x1 up by 4."""

    expansion = 4

    def __init__(self, in_channels: int, width: int, stride: int = 1) -> None:
        super().__init__()
        out_channels = width * self.expansion
        self.conv1 = nn.Conv2d(in_channels, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out_channels, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = _shortcut(in_channels, out_channels, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        result: torch.Tensor = self.relu(out + identity)
        return result


def _shortcut(in_channels: int, out_channels: int, stride: int) -> nn.Sequential | None:
    """A strided 1x1 conv + BN where the block changes shape; the identity (None) elsewhere."""
    if stride == 1 and in_channels == out_channels:
        return None
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, 1, stride, bias=False),
        nn.BatchNorm2d(out_channels),
    )


class ResNet(nn.Module):
    """Stem (7x7/2 conv, 3x3/2 max pool), four stages of blocks, global average pool, fc."""

    def __init__(
        self,
        block: type[BasicBlock | Bottleneck],
        blocks_per_stage: Sequence[int],
        num_classes: int = 1000,
    ) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, padding=1)
        stages: list[nn.Sequential] = []
        in_channels = 64
        for index, count in enumerate(blocks_per_stage):
            width = 64 * 2**index
            stride = 1 if index == 0 else 2
            layers: list[nn.Module] = []
            for block_index in range(count):
                layers.append(block(in_channels, width, stride if block_index == 0 else 1))
                in_channels = width * block.expansion
            stages.append(nn.Sequential(*layers))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(in_channels, num_classes)
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        logits: torch.Tensor = self.fc(torch.flatten(self.avgpool(x), 1))
        return logits


def resnet18(num_classes: int = 1000, image_size: int = 224) -> ResNet:
    """image_size is taken for a uniform signature: the average pool takes any size."""
    return ResNet(BasicBlock, (2, 2, 2, 2), num_classes)


def resnet50(num_classes: int = 1000, image_size: int = 224) -> ResNet:
    """image_size is taken for a uniform signature: the average pool takes any size."""
    return ResNet(Bottleneck, (3, 4, 6, 3), num_classes)


# --- Vision Transformer (Dosovitskiy et al. 2020; pre-norm blocks, class token) ---


class SelfAttention(nn.Module):
    """Multi-head self-attention through scaled_dot_product_attention (flash/memory-efficient
    kernels on CUDA), with nn.MultiheadAttention's parameters: one qkv projection, one out."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim {dim} is not divisible by heads {heads}")
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, dim = x.shape
        qkv = self.qkv(x).reshape(batch, tokens, 3, self.heads, dim // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each (batch, heads, tokens, head_dim)
        out = F.scaled_dot_product_attention(q, k, v)
        result: torch.Tensor = self.proj(out.transpose(1, 2).reshape(batch, tokens, dim))
        return result


class EncoderBlock(nn.Module):
    """x + attention(LN(x)), then x + MLP(LN(x)) with GELU."""

    def __init__(self, dim: int, heads: int, mlp_dim: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim, eps=1e-6)
        self.attention = SelfAttention(dim, heads)
        self.ln_2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(dim, mlp_dim), nn.GELU(), nn.Linear(mlp_dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.ln_1(x))
        result: torch.Tensor = x + self.mlp(self.ln_2(x))
        return result


class VisionTransformer(nn.Module):
    """Patches by a strided conv, a class token, learned position embeddings, pre-norm
    encoder blocks, a final LayerNorm, and a linear head on the class token."""

    def __init__(
        self,
        *,
        image_size: int = 224,
        patch_size: int = 16,
        dim: int,
        depth: int,
        heads: int,
        mlp_dim: int,
        num_classes: int = 1000,
    ) -> None:
        super().__init__()
        if image_size % patch_size:
            raise ValueError(f"image_size {image_size} is not a multiple of patch {patch_size}")
        self.image_size = image_size
        self.conv_proj = nn.Conv2d(3, dim, patch_size, stride=patch_size)
        tokens = (image_size // patch_size) ** 2 + 1  # the patches and the class token
        self.class_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embedding = nn.Parameter(torch.empty(1, tokens, dim).normal_(std=0.02))
        self.layers = nn.Sequential(*(EncoderBlock(dim, heads, mlp_dim) for _ in range(depth)))
        self.ln = nn.LayerNorm(dim, eps=1e-6)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-2:] != (self.image_size, self.image_size):
            raise ValueError(
                f"this ViT takes {self.image_size}x{self.image_size} images (its position "
                f"embeddings are learned per patch), got {x.shape[-2]}x{x.shape[-1]}"
            )
        patches = self.conv_proj(x).flatten(2).transpose(1, 2)  # (batch, patches, dim)
        class_token = self.class_token.expand(x.shape[0], -1, -1)
        tokens = torch.cat([class_token, patches], dim=1) + self.pos_embedding
        logits: torch.Tensor = self.head(self.ln(self.layers(tokens))[:, 0])
        return logits


def vit_b16(num_classes: int = 1000, image_size: int = 224) -> VisionTransformer:
    return VisionTransformer(
        image_size=image_size, dim=768, depth=12, heads=12, mlp_dim=3072, num_classes=num_classes
    )


def vit_s16(num_classes: int = 1000, image_size: int = 224) -> VisionTransformer:
    return VisionTransformer(
        image_size=image_size, dim=384, depth=12, heads=6, mlp_dim=1536, num_classes=num_classes
    )


# Each takes (num_classes=1000, image_size=224).
MODELS: dict[str, Callable[..., nn.Module]] = {
    "resnet18": resnet18,
    "resnet50": resnet50,
    "vit_b16": vit_b16,
    "vit_s16": vit_s16,
}


def build(name: str, num_classes: int = 1000, *, image_size: int = 224) -> nn.Module:
    """The model ``name`` (a key of MODELS); image_size matters to the ViTs only (their
    position embeddings have one row per patch)."""
    factory = MODELS.get(name)
    if factory is None:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}")
    return factory(num_classes=num_classes, image_size=image_size)


def count_parameters(model: nn.Module) -> int:
    return sum(parameter.numel() for parameter in model.parameters())


# --- One training step ---


class ModelStep:
    """One SGD training step of a named model on a device, to time as the doctor's step.

    Built once (model, optimizer, a synthetic batch on the device), then each call runs
    forward, cross-entropy, backward and the optimizer step. On CUDA the call waits for the
    GPU, so its wall time is the step's, not the time to queue its kernels.
    """

    def __init__(
        self,
        name: str,
        *,
        batch_size: int,
        device: str | torch.device = "cpu",
        image_size: int = 224,
        num_classes: int = 1000,
        channels_last: bool | None = None,
        amp: bool | None = None,
        lr: float = 0.01,
    ) -> None:
        if batch_size <= 0:
            raise ValueError(f"batch_size must be > 0, got {batch_size}")
        self.name = name
        self.batch_size = batch_size
        self.device = _resolve(torch.device(device))
        self.image_size = image_size
        self.num_classes = num_classes
        on_cuda = self.device.type == "cuda"
        # channels_last suits cuDNN's tensor-core convolutions; bf16 autocast is what a
        # real GPU training run uses. On CPU both default off: plain fp32 is the common case.
        self.channels_last = on_cuda if channels_last is None else channels_last
        self.amp = on_cuda if amp is None else amp
        self._memory_format = torch.channels_last if self.channels_last else torch.contiguous_format

        self.model = build(name, num_classes, image_size=image_size)
        # Module.to takes memory_format (it lays out the 4-D weights); torch's stubs omit it.
        self.model.to(self.device, memory_format=self._memory_format)  # type: ignore[call-overload]
        self.model.train()
        # A small lr keeps many timed steps on random data from diverging to inf/NaN (which
        # can change the kernels' speed); it does not change the work a step does.
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=lr, momentum=0.9)
        self.loss_fn = nn.CrossEntropyLoss()

        # Per channel, on 0-255 values: (x - 255 mean) / (255 std) == (x / 255 - mean) / std.
        shape = (1, 3, 1, 1)
        self._mean_255 = torch.tensor(IMAGENET_MEAN, device=self.device).reshape(shape) * 255
        self._std_255 = torch.tensor(IMAGENET_STD, device=self.device).reshape(shape) * 255
        generator = torch.Generator(self.device).manual_seed(0)
        pixels = torch.randint(
            0, 256, (batch_size, 3, image_size, image_size),
            dtype=torch.uint8, device=self.device, generator=generator,
        )  # fmt: skip
        self.images = self._normalize(pixels)
        self.labels = torch.randint(
            0, num_classes, (batch_size,), device=self.device, generator=generator
        )

    def __call__(self, batch: Any = None) -> None:
        """One training step on ``batch`` ((images, labels), or images alone, as a fastload
        loader yields) or, without one, on the synthetic batch."""
        images, labels = (self.images, self.labels) if batch is None else self.prepare(batch)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.amp):
            loss = self.loss_fn(self.model(images), labels)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def prepare(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """A loader's batch as the model takes it: on the device, float, normalized, NCHW
        values in the step's memory format, int64 labels within the classes.

        Accepts uint8 (0-255, normalized here with ImageNet's mean/std) or float (taken as
        already normalized) images, NCHW or NHWC, one tensor or a list of equal-shape ones.
        """
        if isinstance(batch, torch.Tensor):
            images_in: Any = batch
            labels_in: Any = None
        elif isinstance(batch, list | tuple) and len(batch) == 2:
            images_in, labels_in = batch
        else:
            raise TypeError(
                f"a batch is (images, labels) or images alone, got {type(batch).__name__}"
            )
        images = _stack(images_in)
        if images.dim() != 4:
            raise ValueError(
                f"images must be (N, C, H, W) or (N, H, W, C), got {tuple(images.shape)}"
            )
        if images.shape[1] != 3 and images.shape[-1] == 3:
            images = images.permute(0, 3, 1, 2)  # NHWC → NCHW (a view; the copy below lays it)
        images = images.to(self.device, non_blocking=True)
        if images.dtype == torch.uint8:
            images = self._normalize(images)
        else:
            images = images.to(torch.float32).contiguous(memory_format=self._memory_format)

        if labels_in is None:
            labels = self.labels[: images.shape[0]]
            if labels.shape[0] < images.shape[0]:
                labels = torch.randint(0, self.num_classes, images.shape[:1], device=self.device)
        else:
            labels = torch.as_tensor(labels_in).to(self.device, non_blocking=True)
            # A dataset with more classes than the head has would fail the loss (a device-
            # side assert on CUDA); folding the labels keeps the step's work the same.
            labels = labels.to(torch.int64).remainder(self.num_classes)
        return images, labels

    def seconds_per_step(self, repeats: int = 3, warmup: int = 1) -> float:
        """Median wall seconds of a step on the synthetic batch, after ``warmup`` steps (the
        first ones pay for cuDNN's algorithm search and the allocator's growth)."""
        if repeats <= 0:
            raise ValueError(f"repeats must be > 0, got {repeats}")
        for _ in range(warmup):
            self()
        times: list[float] = []
        for _ in range(repeats):
            start = time.perf_counter()
            self()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    def describe(self) -> str:
        """One line: what a step does, e.g. for the doctor's report."""
        settings = (("bf16 autocast", self.amp), ("channels_last", self.channels_last))
        modes = [setting for setting, on in settings if on]
        return (
            f"{self.name} forward+backward+SGD, batch {self.batch_size}, "
            f"{self.image_size}x{self.image_size}, on {self.device} ({', '.join(modes) or 'fp32'})"
        )

    def _normalize(self, pixels: torch.Tensor) -> torch.Tensor:
        """uint8 0-255 NCHW on the device → normalized float32 in the step's memory format."""
        images = (pixels.to(torch.float32) - self._mean_255) / self._std_255
        return images.contiguous(memory_format=self._memory_format)


def _resolve(device: torch.device) -> torch.device:
    """cuda → cuda:N (the current one), so describe() names the GPU that runs the step."""
    if str(device) == "cuda":  # (torch's stubs type .index as int: it is None here)
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _stack(images: Any) -> torch.Tensor:
    """One tensor from a tensor or a list of equal-shape tensors (a loader without a resize
    preset yields a list, one tensor per image)."""
    if isinstance(images, torch.Tensor):
        return images
    if (
        isinstance(images, list | tuple)
        and images
        and all(isinstance(image, torch.Tensor) for image in images)
    ):
        shapes = {tuple(image.shape) for image in images}
        if len(shapes) != 1:
            raise ValueError(
                f"the images differ in shape ({len(shapes)} shapes); give the loader a resize "
                "preset (a TrainPreset or EvalPreset transform) so a batch is one tensor"
            )
        return torch.stack(list(images))
    raise TypeError(f"images must be a tensor or a list of tensors, got {type(images).__name__}")
