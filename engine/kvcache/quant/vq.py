"""Product vector quantization: k-means codebooks of sub-vectors, nearest-centroid codes, and the versioned
codebook file that `velox precompute` writes and the `vq` cache loads.

A vector of d coordinates is cut into d/g sub-vectors of g coordinates; each sub-vector is replaced by the
index of its nearest centroid among K = 2^(bits·g) (bits per coordinate × g coordinates per index). Arithmetic
is float32 and vectorised over every leading axis.

The file (safetensors) holds, per layer and role (key, value): the per-channel smoothing scales [L, d] and
the centroids [L, K, g]; its metadata holds the format name and version, the model's identity (name, a hash
of its architecture arguments, its shape), the settings (bits, g, rotation and seed) and a SHA-256 checksum
of every array, which loading verifies: a file that does not belong to the model, or was changed, is a clear
ConfigError rather than silently worse attention.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from engine.errors import ConfigError

FORMAT = "velox-vq-codebooks"
VERSION = 1
ROLES = ("key", "value")
# Index bits per sub-vector (K = 256 centroids) for each supported bits-per-coordinate setting; 3 bits per
# coordinate uses pairs with 64 centroids (6-bit indices).
SUBSPACE_DIM = {1: 8, 2: 4, 3: 2, 4: 2}
# Sub-vectors compared against the codebook at once when encoding (bounds the distance temporary).
_ENCODE_CHUNK = 1 << 15


def subspace_dim(bits: int) -> int:
    try:
        return SUBSPACE_DIM[bits]
    except KeyError:
        raise ConfigError(f"Product VQ supports {', '.join(map(str, SUBSPACE_DIM))} bits per coordinate, not {bits}.") from None


def index_bits(bits: int) -> int:
    return bits * subspace_dim(bits)


def codebook_file_name(bits: int) -> str:
    return f"vq-{bits}bit.safetensors"


def nearest_centroid(x: mx.array, centroids: mx.array) -> mx.array:
    """Index (uint32) of the nearest centroid [K, g] for each sub-vector x [..., g]."""
    centroids = centroids.astype(mx.float32)
    flat = x.astype(mx.float32).reshape(-1, x.shape[-1])
    squared = mx.sum(centroids * centroids, axis=-1)
    parts = []
    for start in range(0, flat.shape[0], _ENCODE_CHUNK):
        block = flat[start : start + _ENCODE_CHUNK]
        # ‖x - c‖² = ‖x‖² - 2 x·c + ‖c‖²; ‖x‖² is the same for every c, so it is left out of the argmin.
        parts.append(mx.argmin(squared - 2 * (block @ centroids.T), axis=-1).astype(mx.uint32))
    codes = parts[0] if len(parts) == 1 else mx.concatenate(parts)
    return codes.reshape(x.shape[:-1])


def kmeans(data: mx.array, n_centroids: int, iterations: int = 25, seed: int = 0) -> mx.array:
    """Lloyd's k-means of data [N, g] (float32) into n_centroids centroids; empty clusters restart at
    random data points. Deterministic for a seed."""
    data = data.astype(mx.float32)
    rng = np.random.default_rng(seed)
    n = data.shape[0]
    if n < n_centroids:
        raise ConfigError(f"k-means needs at least {n_centroids} calibration vectors, got {n}.")
    centroids = data[mx.array(rng.choice(n, n_centroids, replace=False))]
    ones = mx.ones((n,), dtype=mx.float32)
    for _ in range(iterations):
        assignment = nearest_centroid(data, centroids)
        sums = mx.zeros_like(centroids).at[assignment].add(data)
        counts = mx.zeros((n_centroids,), dtype=mx.float32).at[assignment].add(ones)
        restart = data[mx.array(rng.integers(0, n, n_centroids))]
        centroids = mx.where((counts > 0)[:, None], sums / mx.maximum(counts, 1)[:, None], restart)
        mx.eval(centroids)
    return centroids


# ----- the codebook file -----------------------------------------------------------------------------------


def model_identity(model: Any, name: str = "") -> dict[str, Any]:
    """What identifies a model to its codebooks: its name, a hash of its architecture arguments, its shape."""
    # The builder imports the methods, which import this module: imported here, not at the top.
    from engine.kvcache.builder import model_shape

    args = getattr(model, "args", None)
    described = json.dumps(vars(args) if args is not None else {}, sort_keys=True, default=str)
    shape = model_shape(model)
    return {
        "name": name,
        "args_sha256": hashlib.sha256(described.encode()).hexdigest(),
        "n_layers": shape.n_layers,
        "n_kv_heads": shape.n_kv_heads,
        "head_dim": shape.head_dim,
    }


# Elements sampled from each weight array by `weights_fingerprint` (evenly strided over the whole array).
FINGERPRINT_SAMPLES = 1024


# The attribute the model loader (engine.models.catalog.load_model) sets on the model it returns: the fingerprint of the
# weights as the checkpoint gives them, taken before the device's own preparation (fp32 weights on the CPU, 16-bit
# norms on a GPU). One checkpoint then has one fingerprint on every device, so a calibration or codebook made on one
# (the bundled ones are made on the CPU) is found on the others; taken after, a GPU or a Mac missed them and measured
# its own.
FINGERPRINT_ATTRIBUTE = "velox_weights_fingerprint"


def weights_fingerprint(model: Any) -> str:
    """The fingerprint of `model`'s weights: the loader's (FINGERPRINT_ATTRIBUTE) where it set one, else
    `sampled_fingerprint` of the weights as they are."""
    stamped = getattr(model, FINGERPRINT_ATTRIBUTE, None)
    return stamped if isinstance(stamped, str) else sampled_fingerprint(model)


def sampled_fingerprint(model: Any) -> str:
    """A sha256 over every parameter's name, shape, dtype and FINGERPRINT_SAMPLES elements strided over it.

    `model_identity` hashes the architecture only, which two fine-tunes of one base share; a fine-tune (or a
    merged adapter, a low-rank update that touches every element of a matrix) changes the sampled elements.
    Sampling keeps it cheap for large models (the full weights of an 8B model would take seconds to hash)."""
    from mlx.utils import tree_flatten  # kept beside its one use, as model_identity's model_shape import is

    digest = hashlib.sha256()
    for name, array in sorted(tree_flatten(model.parameters()), key=lambda item: item[0]):
        flat = array.reshape(-1)
        stride = max(1, flat.size // FINGERPRINT_SAMPLES)
        sample = flat[::stride][:FINGERPRINT_SAMPLES]
        if mx.issubdtype(sample.dtype, mx.floating):
            sample = sample.astype(mx.float32)  # numpy has no bfloat16; float32 holds every 16-bit float exactly
        digest.update(f"{name}:{tuple(array.shape)}:{array.dtype}".encode())
        digest.update(np.asarray(sample).tobytes())
    return digest.hexdigest()


def arrays_checksum(arrays: dict[str, mx.array]) -> str:
    digest = hashlib.sha256()
    for name in sorted(arrays):
        digest.update(name.encode())
        digest.update(np.asarray(arrays[name]).tobytes())
    return digest.hexdigest()


@dataclass(frozen=True)
class VQCodebooks:
    """The codebooks of one file: arrays `{role}_smooth` [L, d] and `{role}_centroids` [L, K, g]."""

    path: str
    bits: int
    subspace_dim: int
    rotation: str
    seed: int
    model: dict[str, Any]
    checksum: str
    arrays: dict[str, mx.array]

    def layer(self, role: str, layer_index: int) -> tuple[mx.array, mx.array]:
        """(smoothing scales [d], centroids [K, g]) of one layer, as arrays of their own (not views)."""
        return (
            mx.contiguous(self.arrays[f"{role}_smooth"][layer_index]),
            mx.contiguous(self.arrays[f"{role}_centroids"][layer_index]),
        )


def save_codebooks(
    out_dir: str | Path,
    bits: int,
    arrays: dict[str, mx.array],
    model: dict[str, Any],
    rotation: str,
    seed: int,
) -> Path:
    path = Path(out_dir).expanduser() / codebook_file_name(bits)
    path.parent.mkdir(parents=True, exist_ok=True)
    metadata = {
        "format": FORMAT,
        "version": str(VERSION),
        "bits": str(bits),
        "subspace_dim": str(subspace_dim(bits)),
        "rotation": rotation,
        "seed": str(seed),
        "model": json.dumps(model, sort_keys=True),
        "checksum": arrays_checksum(arrays),
    }
    mx.save_safetensors(str(path), arrays, metadata=metadata)
    return path


def resolve_codebook_path(location: str, bits: int) -> Path:
    """A codebook file: `location` itself, or the file for `bits` inside the folder `location`."""
    path = Path(location).expanduser()
    return path / codebook_file_name(bits) if path.is_dir() else path


_LOADED: dict[tuple[str, float], VQCodebooks] = {}


def load_codebooks(location: str, bits: int) -> VQCodebooks:
    """Read and verify a codebook file (cached per path and modification time)."""
    path = resolve_codebook_path(location, bits)
    if not path.is_file():
        raise ConfigError(
            f"No VQ codebooks at {path}; write them with `velox precompute MODEL --bits {bits} --out DIR`."
        )
    key = (str(path.resolve()), path.stat().st_mtime)
    if key in _LOADED:
        return _LOADED[key]
    try:
        arrays, metadata = mx.load(str(path), return_metadata=True)
    except Exception as error:  # not a safetensors file
        raise ConfigError(f"Cannot read the VQ codebooks {path}: {error}") from None
    if metadata.get("format") != FORMAT or metadata.get("version") != str(VERSION):
        raise ConfigError(
            f"{path} is not a version-{VERSION} Velox VQ codebook file "
            f"(format {metadata.get('format')!r}, version {metadata.get('version')!r}); run `velox precompute` again."
        )
    if int(metadata["bits"]) != bits:
        raise ConfigError(f"The VQ codebooks in {path} are for {metadata['bits']}-bit codes, not {bits}-bit.")
    if arrays_checksum(arrays) != metadata.get("checksum"):
        raise ConfigError(f"The VQ codebooks in {path} do not match their checksum (the file was changed or damaged).")
    loaded = VQCodebooks(
        path=str(path),
        bits=bits,
        subspace_dim=int(metadata["subspace_dim"]),
        rotation=metadata["rotation"],
        seed=int(metadata["seed"]),
        model=json.loads(metadata["model"]),
        checksum=metadata["checksum"],
        arrays=arrays,
    )
    _LOADED[key] = loaded
    return loaded


def check_model(codebooks: VQCodebooks, identity: dict[str, Any]) -> None:
    """ConfigError unless the codebooks were calibrated on a model with this identity."""
    recorded = codebooks.model
    for field in ("n_layers", "n_kv_heads", "head_dim", "args_sha256"):
        if recorded.get(field) != identity.get(field):
            raise ConfigError(
                f"The VQ codebooks {codebooks.path} were calibrated on {recorded.get('name') or 'another model'} "
                f"({field} {recorded.get(field)!r}), not on this model ({identity.get(field)!r}); "
                "run `velox precompute` for this model."
            )
