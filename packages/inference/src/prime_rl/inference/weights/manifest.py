"""What a weight update must contain, and the checks that refuse a bad one before it reaches the model.

The manifest is read once at start-up from the served model's own safetensors headers: every tensor
name and shape of the checkpoint. An update (a ``broadcasts/step_<n>/`` directory or a broadcast's
spec list) must name exactly those tensors with those shapes, in the dtype the engine runs in. All of
this is pure Python (safetensors headers are JSON), so it runs in the API process in milliseconds and a
refused update never touches the workers.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from prime_rl.common.weight_checksum import safetensors_layout
from prime_rl.common.weight_layout import ALIGNMENT as BUCKET_ALIGNMENT
from prime_rl.common.weight_layout import SAFETENSORS_DTYPES  # codes -> wire.TensorSpec dtype names
from prime_rl.common.wire import DTYPE_ITEMSIZE, TensorSpec, tensor_bytes

ITEMSIZE = DTYPE_ITEMSIZE  # one table for every transport, in prime_rl.common.wire
FLOAT_DTYPES = {"float64", "float32", "float16", "bfloat16"}
MAX_LISTED = 5


STILL_SERVED = "is still served"
"""Said by every failed-update message after which a named, complete version serves (nothing reached the
model, or it was rolled back): the controller keeps health ok for those and fails it for the others."""


class WeightUpdateError(ValueError):
    """A weight update was refused; the message says what is wrong and how to fix it."""


@dataclass(frozen=True)
class Spec:
    """One tensor's dtype name (a key of ``ITEMSIZE``) and shape; its size is ``wire.tensor_bytes``."""

    dtype: str
    shape: tuple[int, ...]


def read_safetensors_header(file: Path) -> dict[str, Spec]:
    """Tensor specs of one safetensors file, from its JSON header (no tensor data is read)."""
    try:
        _, header = safetensors_layout(file)
    except ValueError as e:  # names the file and the check that failed
        raise WeightUpdateError(str(e)) from e
    specs = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        code = info["dtype"]
        if code not in SAFETENSORS_DTYPES:
            raise WeightUpdateError(f"{file}: tensor {name} has unsupported dtype {code}")
        specs[name] = Spec(SAFETENSORS_DTYPES[code], tuple(info["shape"]))
    return specs


def read_safetensors_dir(path: Path) -> dict[str, Spec]:
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise WeightUpdateError(f"no *.safetensors files in {path}; the trainer writes model*.safetensors there")
    specs: dict[str, Spec] = {}
    for file in files:
        for name, spec in read_safetensors_header(file).items():
            if name in specs:
                raise WeightUpdateError(
                    f"tensor {name} appears in two files of {path}; each tensor must be written once"
                )
            specs[name] = spec
    return specs


def _listed(names: Iterable[str]) -> str:
    names = sorted(names)
    more = f" (+{len(names) - MAX_LISTED} more)" if len(names) > MAX_LISTED else ""
    return ", ".join(names[:MAX_LISTED]) + more


@dataclass
class Manifest:
    """The tensors every update must carry: name -> (dtype, shape), plus names that may be sent but need not."""

    expected: dict[str, Spec]
    optional: dict[str, Spec]

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, served_dtype: str, tie_word_embeddings: bool) -> Manifest:
        """``served_dtype`` is the engine's dtype (a torch dtype name): floating tensors must arrive in it."""
        checkpoint = read_safetensors_dir(Path(model_dir))
        expected = {
            name: Spec(served_dtype if spec.dtype in FLOAT_DTYPES else spec.dtype, spec.shape)
            for name, spec in checkpoint.items()
        }
        optional: dict[str, Spec] = {}
        embed = expected.get("model.embed_tokens.weight")
        if tie_word_embeddings and embed is not None and "lm_head.weight" not in expected:
            # A trainer's state dict of a tied model names the shared tensor twice; vLLM skips the copy.
            optional["lm_head.weight"] = embed
        return cls(expected=expected, optional=optional)

    def check_transfer(
        self,
        tensors: Sequence[TensorSpec],
        buckets: list[int],
        offsets: list[int],
        bucket_sizes: list[int],
        source: str,
    ) -> list[str]:
        """Refuse a transfer (a broadcast's buckets, a NIXL session's groups) unless its tensors have known dtypes,
        fit their buckets in order (``check_bucket_layout``) and are exactly these. Returns their names in order."""
        for spec in tensors:
            if spec.dtype not in ITEMSIZE:
                raise WeightUpdateError(f"tensor {spec.name} has unsupported dtype {spec.dtype!r}")
        specs = {s.name: Spec(s.dtype, tuple(s.shape)) for s in tensors}
        names = [s.name for s in tensors]
        check_bucket_layout(names, [specs[n] for n in names], buckets, offsets, bucket_sizes)
        self.check(specs, source=source)
        return names

    def check(self, update: Mapping[str, Spec], source: str) -> None:
        """Raise ``WeightUpdateError`` naming every kind of mismatch between ``update`` and the manifest."""
        problems = []
        missing = self.expected.keys() - update.keys()
        if missing:
            problems.append(f"{len(missing)} tensor(s) missing: {_listed(missing)}")
        unknown = update.keys() - self.expected.keys() - self.optional.keys()
        if unknown:
            problems.append(f"{len(unknown)} tensor(s) the served model does not have: {_listed(unknown)}")
        wanted = {**self.optional, **self.expected}
        for field, shown in (("shape", lambda s: list(s.shape)), ("dtype", lambda s: s.dtype)):
            wrong = [
                f"{n} {shown(s)} (expected {shown(wanted[n])})"
                for n, s in update.items()
                if n in wanted and getattr(s, field) != getattr(wanted[n], field)
            ]
            if wrong:
                problems.append(f"wrong {field}: {_listed(wrong)}")
        if problems:
            raise WeightUpdateError(
                f"refused weight update from {source}: " + "; ".join(problems) + ". "
                "An update must carry every tensor of the served checkpoint with its shape, in the served dtype; "
                "the server keeps the previous weights"
            )


def check_checkpoint_dir(path: str | Path, marker: str) -> dict[str, Spec]:
    """Specs of a complete ``broadcasts/step_<n>/`` directory; refuses one the trainer has not finished."""
    path = Path(path)
    if not path.is_dir():
        raise WeightUpdateError(f"checkpoint directory {path} does not exist; check the run directory and step")
    if not (path / marker).exists():
        raise WeightUpdateError(
            f"checkpoint {path} has no {marker} marker, so the trainer has not finished writing it; "
            "retry after the marker appears"
        )
    return read_safetensors_dir(path)


def check_bucket_layout(
    names: list[str], specs: list[Spec], buckets: list[int], offsets: list[int], bucket_sizes: list[int]
) -> None:
    """Refuse a broadcast layout whose tensors do not fit, overlap, or are out of order in their buckets."""
    n = len(names)
    if not (len(specs) == len(buckets) == len(offsets) == n):
        raise WeightUpdateError(
            f"broadcast layout lists {len(buckets)} bucket ids and {len(offsets)} offsets for {n} tensors; "
            "send one of each per tensor"
        )
    if len(set(names)) != n:
        raise WeightUpdateError("broadcast names a tensor twice; each tensor must be sent once")
    end_of = [0] * len(bucket_sizes)
    last_bucket = 0
    for name, spec, b, off in zip(names, specs, buckets, offsets):
        if not 0 <= b < len(bucket_sizes) or b < last_bucket:
            raise WeightUpdateError(
                f"tensor {name} is in bucket {b}; buckets must be 0..{len(bucket_sizes) - 1}, in non-decreasing order"
            )
        size = tensor_bytes(spec.dtype, spec.shape)
        if off % BUCKET_ALIGNMENT or off < end_of[b] or off + size > bucket_sizes[b]:
            raise WeightUpdateError(
                f"tensor {name} at byte {off} of bucket {b} ({size} bytes, bucket {bucket_sizes[b]} bytes) "
                f"overlaps the previous tensor, is not {BUCKET_ALIGNMENT}-byte aligned or does not fit"
            )
        end_of[b] = off + size
        last_bucket = b
