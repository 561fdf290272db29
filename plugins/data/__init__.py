"""Data sources: ``synthetic``, ``token_bin`` (nanoGPT's train.bin / val.bin) and ``mixture``."""

from core.api import hookimpl


@hookimpl
def plait_register(registry):
    from plugins.data.mixture import Mixture, MixtureOptions
    from plugins.data.synthetic import Synthetic, SyntheticOptions
    from plugins.data.text_stream import TextStream, TextStreamOptions
    from plugins.data.token_bin import TokenBin, TokenBinOptions

    registry.add("data", "synthetic", Synthetic, options=SyntheticOptions, doc="deterministic generated tokens, a pure function of (seed, sample index)")
    registry.add("data", "token_bin", TokenBin, options=TokenBinOptions, doc="nanoGPT flat binary token files, memory-mapped, windows drawn from (seed, index)")
    registry.add(
        "data",
        "mixture",
        Mixture,
        options=MixtureOptions,
        doc="weighted mixture of indexed and streaming sources; the source of each sample index is deterministic",
    )
    registry.add(
        "data",
        "text_stream",
        TextStream,
        options=TextStreamOptions,
        doc="jsonl/parquet read lazily, tokenized on the fly, packed, shuffle buffer; resumable mid-epoch",
    )
