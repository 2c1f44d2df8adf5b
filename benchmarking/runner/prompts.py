"""The exact requests of a shape: prompts of token ids (distinct per request but for the
shape's shared prefix), or chat messages of words and inline PNG images."""

import base64
import struct
import zlib

from benchmarking.runner.spec import GridShape


def prompt_token_ids(input_len: int, salt: int) -> list[int]:
    # Distinct ids per request, so an engine's prefix cache cannot make later requests cheaper.
    return [100 + (salt * 7919 + index * 104729) % 30000 for index in range(input_len)]


def shared_prefix_token_ids(shape: GridShape) -> list[int]:
    """The prefix every request of the shape starts with: the same for all of them, and in a
    range of ids the salted parts never use, so it is cached only where the shape means it."""
    key = shape.input_len * 31 + shape.output_len * 7 + shape.images
    return [30100 + (key * 104729 + index * 7919) % 30000 for index in range(shape.shared_tokens)]


def shape_prompt_ids(shape: GridShape, salt: int) -> list[int]:
    """A prompt of the shape: its shared prefix, then ids salted per request."""
    shared = shared_prefix_token_ids(shape)
    return shared + prompt_token_ids(shape.input_len - len(shared), salt)


def png_data_url(salt: int) -> str:
    """A 1×1 PNG whose colour comes from the salt (so images differ between requests), as a
    data: URL, the form OpenAI's and vLLM's image_url parts take inline."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    colour = (salt % (1 << 24)).to_bytes(3, "big")
    png = (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", 1, 1, 8, 2, 0, 0, 0))
        + chunk(b"IDAT", zlib.compress(b"\x00" + colour))
        + chunk(b"IEND", b"")
    )
    return "data:image/png;base64," + base64.b64encode(png).decode()


def chat_messages(shape: GridShape, salt: int) -> list[dict]:
    """A chat request of the shape: the shared prefix as text, the images, then the salted
    text. Words are the tokens of text prompts; the engine's own count is what is recorded."""
    ids = shape_prompt_ids(shape, salt)
    shared = shape.shared_tokens
    content: list[dict] = []
    if shared:
        content.append({"type": "text", "text": " ".join(f"w{i}" for i in ids[:shared])})
    content.extend(
        {"type": "image_url", "image_url": {"url": png_data_url(salt * 8 + index)}}
        for index in range(shape.images)
    )
    if len(ids) > shared:
        content.append({"type": "text", "text": " ".join(f"w{i}" for i in ids[shared:])})
    return [{"role": "user", "content": content}]
