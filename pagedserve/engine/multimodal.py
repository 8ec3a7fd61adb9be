"""Images in the prompt, the frontend side: an image from a request (a PIL image offline; a data URL
in a chat `image_url` part) checked and decoded, and a prompt's image placeholders expanded to the
model's image-token count, each run of image tokens an `MMFeature` (content hash, position, pixels)
the scheduler and runner carry (model/vision.py encodes it).

Nothing is fetched: an http(s) URL is refused unless its host is in `--allowed-media-domains`, and
even then (fetching is not implemented) refused saying so, so no request makes the server reach
another host. Every refusal is a ParamError naming the field."""
from __future__ import annotations

import base64
import binascii
import io
import json
import os
from urllib.parse import urlparse

from pagedserve.core.request import MMFeature
from pagedserve.errors import ParamError

MAX_IMAGE_PIXELS = 4096 * 4096          # larger images are refused before their pixels are decoded
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
MAX_IMAGE_BYTES = 20 * 2**20
DEFAULT_IMAGE_LIMIT = 4                 # images per prompt unless --limit-mm-per-prompt says otherwise


def image_limit(value) -> int:
    """--limit-mm-per-prompt, vLLM's JSON ({"image": N}) -> N; ValueError names the flag."""
    if value is None:
        return DEFAULT_IMAGE_LIMIT
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"limit_mm_per_prompt must be a JSON object like {{\"image\": 2}}, got {value!r} ({e})") \
                from None
    if not isinstance(value, dict) or set(value) - {"image"}:
        raise ValueError(f"limit_mm_per_prompt takes the key \"image\" only (the one modality served), got {value!r}")
    n = value.get("image", DEFAULT_IMAGE_LIMIT)
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ValueError(f"limit_mm_per_prompt.image must be a non-negative integer, got {n!r}")
    return n


def decode_image(data: bytes, param: str):
    """Bytes of an image file -> an RGB PIL image; refused (naming `param`) when not an image, of a
    format not served, truncated, corrupt or over MAX_IMAGE_PIXELS (checked from the header first)."""
    from PIL import Image, UnidentifiedImageError
    if len(data) > MAX_IMAGE_BYTES:
        raise ParamError(param, f"{param}: the image is {len(data)} bytes, more than the {MAX_IMAGE_BYTES} allowed")
    try:
        img = Image.open(io.BytesIO(data))
    except UnidentifiedImageError:
        raise ParamError(param, f"{param}: not an image of a supported format ({', '.join(IMAGE_FORMATS)})") from None
    except Exception as e:         # PIL raises many kinds on a malformed header (incl. decompression bombs)
        raise ParamError(param, f"{param}: the image cannot be read ({type(e).__name__}: {e})") from None
    if img.format not in IMAGE_FORMATS:
        raise ParamError(param, f"{param}: image format {img.format} is not supported ({', '.join(IMAGE_FORMATS)})")
    _check_pixels(img, param)
    try:
        img.load()                 # a truncated or corrupt body fails here, not in the engine
        return img.convert("RGB")
    except Exception as e:
        raise ParamError(param, f"{param}: the image is truncated or corrupt ({type(e).__name__}: {e})") from None


def _check_pixels(img, param: str) -> None:
    w, h = img.size
    if w < 1 or h < 1 or w * h > MAX_IMAGE_PIXELS:
        raise ParamError(param, f"{param}: the image is {w}x{h} pixels; at most {MAX_IMAGE_PIXELS} are allowed")


def image_from_url(url: str, param: str, allowed_domains: list[str] | None):
    """An `image_url` part's URL -> an RGB PIL image. data: URLs (base64) are decoded here; http(s)
    URLs are refused: outside --allowed-media-domains always, inside because fetching is not
    implemented (said in the message); any other scheme is refused."""
    if not isinstance(url, str):
        raise ParamError(param, f"{param}: must be a string URL")
    if url.startswith("data:"):
        head, sep, payload = url[5:].partition(",")
        if not sep or not head.endswith(";base64") or not head.startswith("image/"):
            raise ParamError(param, f"{param}: a data URL must be data:image/<format>;base64,<data>")
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise ParamError(param, f"{param}: the data URL's base64 is invalid") from None
        return decode_image(data, param)
    parsed = urlparse(url)
    if parsed.scheme in ("http", "https"):
        host = (parsed.hostname or "").lower()
        if not allowed_domains or host not in {d.lower() for d in allowed_domains}:
            raise ParamError(param, f"{param}: the domain {host!r} is not in --allowed-media-domains; send the image "
                                    "as a data URL (data:image/png;base64,...)")
        raise ParamError(param, f"{param}: fetching images over {parsed.scheme} is not implemented; send the image "
                                "as a data URL (data:image/png;base64,...)")
    raise ParamError(param, f"{param}: URL scheme {parsed.scheme or url[:16]!r} is not supported (data: URLs only)")


class ImageInputs:
    """A vision-language model's image inputs: its processor (HF's, saved with the model: the pixels
    HF's own processor makes), its image token and count, and the per-prompt limit. An image is one
    encoder input (LLaVA: `seq_len` image tokens; LLaVA-NeXT: as many as its size gives) or several
    (Idefics3: one per crop of the split image, each `seq_len` image tokens, between the tokens HF's
    processor writes around them)."""

    def __init__(self, path: str, vision_cfg, limit: int, tokenizer):
        from pagedserve.model.families import from_transformers
        from pagedserve.model.gemma3_vision import Gemma3VisionConfig
        from pagedserve.model.idefics3 import Idefics3VisionConfig
        from pagedserve.model.llava_next import LlavaNextVisionConfig
        from pagedserve.model.mmproj import MmprojVisionConfig
        from pagedserve.model.qwen2_5_vl import QwenVLVisionConfig
        if isinstance(vision_cfg, MmprojVisionConfig):   # llama.cpp's file: no saved processor, no image token
            self.processor, self.token_id = vision_cfg.image_processor(), vision_cfg.image_token(tokenizer)
        else:
            self.processor = from_transformers("AutoImageProcessor").from_pretrained(path)
            self.token_id: int = vision_cfg.image_token_id
        self.seq_len: int = vision_cfg.image_seq_len
        self.limit = limit
        # Gemma 3: the text names an image by <start_of_image>, written out around image_token x seq_len
        self.gemma3 = isinstance(vision_cfg, Gemma3VisionConfig)
        self.placeholder_id: int = vision_cfg.boi_token_id if self.gemma3 else self.token_id
        self.eoi_id: int | None = vision_cfg.eoi_token_id if self.gemma3 else None
        self.placeholder: str = tokenizer.convert_ids_to_tokens(self.placeholder_id)   # its text in a chat turn
        self.chat_placeholder = f"{self.placeholder}\n"     # what a chat turn writes per image, before its text
        # Qwen2.5-VL: a count per size (its processor's grid), each image's token grid on its MMFeature (M-RoPE)
        self.qwen = vision_cfg if isinstance(vision_cfg, QwenVLVisionConfig) else None
        self.tokenizer = tokenizer
        self._layouts: dict[tuple[int, int], list[int]] = {}   # (rows, cols) -> an image's ids (Idefics3)
        self._newline: dict[int, int] = {}                      # token id -> the newlines it is (Gemma 3)
        self.split = isinstance(vision_cfg, Idefics3VisionConfig)     # crops, and the tokens written around them
        self.anyres = vision_cfg if isinstance(vision_cfg, LlavaNextVisionConfig) else None   # a count per size
        if self.split:
            _check_idefics3_processor(path, self.processor, vision_cfg)
        if self.anyres:
            self.anyres.check_processor(path, self.processor)
        if self.qwen:         # (as Qwen's chat template writes an image part: no newline)
            self.qwen.check_processor(path, self.processor)
            self.chat_placeholder = "".join(tokenizer.convert_ids_to_tokens(
                [vision_cfg.vision_start_token_id, self.token_id, vision_cfg.vision_end_token_id]))
        if self.gemma3:
            _check_gemma3_processor(path, self.processor, vision_cfg)
            from pagedserve.model.gemma3_vision import image_prompt
            name = tokenizer.convert_ids_to_tokens
            self._gemma3_ids = tokenizer.encode(image_prompt(self.placeholder, name(self.token_id), name(self.eoi_id),
                                                             self.seq_len), add_special_tokens=False)

    def prompt(self, ids: list[int], urls: list[tuple[str, str]], allowed_domains: list[str] | None) -> dict:
        """A templated chat prompt and the image URLs its turns named (with the field naming each) -> the
        engine's prompt: the images decoded (refused past the per-prompt limit first) and expanded."""
        if not urls:
            return {"prompt_token_ids": ids}
        if len(urls) > self.limit:
            raise ParamError("messages", f"messages: more than {self.limit} images in the prompt "
                                         "(--limit-mm-per-prompt)")
        images = [image_from_url(url, param, allowed_domains) for url, param in urls]
        ids, feats = self.expand(ids, images, "messages")
        return {"prompt_token_ids": ids, "mm_features": feats}

    def _image(self, img) -> tuple[list[int], list]:
        """One image -> the ids it stands for in the prompt and its encoder inputs (pixels), in order."""
        if self.anyres:
            from pagedserve.model.llava_next import AnyresImage
            out = self.processor(images=[img], return_tensors="pt")
            size = tuple(out["image_sizes"][0].tolist())
            return [self.token_id] * self.anyres.image_tokens(*size), [AnyresImage(out["pixel_values"][0], size)]
        if self.qwen:
            from pagedserve.model.qwen2_5_vl import QwenVLImage, image_tokens
            out = self.processor(images=[img], return_tensors="pt")
            grid = tuple(out["image_grid_thw"][0].tolist())
            rows, cols = image_tokens(grid, self.qwen.spatial_merge_size)
            return [self.token_id] * (rows * cols), [QwenVLImage(out["pixel_values"], grid)]
        if self.gemma3:             # (every image the same ids: tokenized once, at start)
            return self._gemma3_ids, [self.processor(images=[img], return_tensors="pt")["pixel_values"][0]]
        if not self.split:
            pixels = self.processor(images=[img], return_tensors="pt")["pixel_values"][0]
            return [self.token_id] * self.seq_len, [pixels]
        from pagedserve.model.idefics3 import image_prompt
        out = self.processor(images=[[img]], return_row_col_info=True, return_tensors="pt")
        grid = (out["rows"][0][0], out["cols"][0][0])
        if grid not in self._layouts:          # (a few grids recur: their ids tokenized once)
            self._layouts[grid] = self.tokenizer.encode(image_prompt(*grid, self.seq_len), add_special_tokens=False)
        rep, pixels = self._layouts[grid], list(out["pixel_values"][0])
        if rep.count(self.token_id) != len(pixels) * self.seq_len:   # (the tokenizer split a tag into image tokens)
            raise RuntimeError(f"an image's prompt has {rep.count(self.token_id)} image tokens for {len(pixels)} crops "
                               f"of {self.seq_len}: the tokenizer does not keep Idefics3's image tags whole")
        return rep, pixels

    def expand(self, ids: list[int], images: list, param: str) -> tuple[list[int], tuple[MMFeature, ...]]:
        """Each image placeholder (one token) -> the image's ids (its seq_len image tokens per encoder
        input, and what the family writes around them), each encoder input an MMFeature (the prompt's images
        in order). A prompt already expanded (ids built by HF's processor) is taken as it is."""
        from pagedserve.model.vision import image_hash
        if len(images) > self.limit:
            raise ParamError(param, f"{param}: {len(images)} images, more than the {self.limit} allowed per prompt "
                                    "(--limit-mm-per-prompt)")
        if self.gemma3 and self.token_id in ids:       # Gemma 3's placeholder is not its image token: expanded
            return ids, self._as_is(ids, images, param)
        at = [i for i, t in enumerate(ids) if t == self.placeholder_id]
        if len(at) < len(images):
            raise self._mismatch(param, len(at), len(images))
        parts = [self._image(img) for img in images]     # (after the cheap checks: the processor is not)
        spots = [(i, 1) for i in at] if len(at) == len(images) else None if self.gemma3 else \
            self._expanded(ids, at, parts)
        if spots is None:
            raise self._mismatch(param, len(at), len(images))
        out: list[int] = []
        feats = []
        prev = 0
        for (i, width), img, (rep, pixels) in zip(spots, images, parts):
            self._join(out, ids[prev:i])
            self._join(out, rep)
            first = len(out) - len(rep)                 # (a join changes only newline tokens before the image's)
            h = image_hash(img)
            for n, ((k, length), px) in enumerate(zip(_runs(rep, self.token_id), pixels)):   # a feature per run
                feats.append(MMFeature(h if len(pixels) == 1 else f"{h}:{n}", first + k, length, px, self._grid(px)))
            prev = i + width
        self._join(out, ids[prev:])
        return out, tuple(feats)

    def _grid(self, px) -> tuple[int, ...]:
        """An encoder input's token grid where positions are 2D (Qwen2.5-VL's M-RoPE), else ()."""
        if not self.qwen:
            return ()
        from pagedserve.model.qwen2_5_vl import image_tokens
        return image_tokens(px.grid, self.qwen.spatial_merge_size)

    def _join(self, out: list[int], more: list[int]) -> None:
        """out += more; for Gemma 3 the newline tokens meeting at the seam tokenized again as one run, as
        HF's processor tokenizes the text it wrote ("\n" then "\n\n" is one "\n\n\n" token there)."""
        if not (self.gemma3 and out and more and self._is_newline(out[-1]) and self._is_newline(more[0])):
            out.extend(more)
            return
        a, b = len(out), 0
        while a and self._is_newline(out[a - 1]):
            a -= 1
        while b < len(more) and self._is_newline(more[b]):
            b += 1
        run = "\n" * sum(self._newlines(t) for t in out[a:] + list(more[:b]))
        out[a:] = self.tokenizer.encode(run, add_special_tokens=False)
        out.extend(more[b:])

    def _newlines(self, t: int) -> int:
        """How many newlines token t is (0: it is something else)."""
        if t not in self._newline:
            text = self.tokenizer.decode([t])
            self._newline[t] = len(text) if text and set(text) == {"\n"} else 0
        return self._newline[t]

    def _is_newline(self, t: int) -> bool:
        return self._newlines(t) > 0

    def _as_is(self, ids: list[int], images: list, param: str) -> tuple[MMFeature, ...]:
        """Gemma 3 ids HF's processor expanded: one run of seq_len image tokens, then end-of-image, per image."""
        from pagedserve.model.vision import image_hash
        runs = _runs(ids, self.token_id)
        if len(runs) != len(images) or any(n != self.seq_len or ids[k + n:k + n + 1] != [self.eoi_id] for k, n in runs):
            raise ParamError(param, f"{param}: the prompt's image tokens are not {len(images)} runs of {self.seq_len} "
                                    "(one per image, as HF's processor writes them)")
        return tuple(MMFeature(image_hash(img), k, n, self._image(img)[1][0]) for (k, n), img in zip(runs, images))

    def _expanded(self, ids: list[int], at: list[int], parts: list) -> list[tuple[int, int]] | None:
        """Where each image's ids already stand in a prompt expanded by HF's processor (start, length), or
        None when the prompt's image tokens are not exactly the images' expansions, in order."""
        spots, j, end = [], 0, 0
        for rep, _ in parts:
            start = at[j] - rep.index(self.token_id) if j < len(at) else -1
            if start < end or ids[start:start + len(rep)] != rep:
                return None
            spots.append((start, len(rep)))
            j, end = j + rep.count(self.token_id), start + len(rep)
        return spots if j == len(at) else None

    def _mismatch(self, param: str, tokens: int, images: int) -> ParamError:
        return ParamError(param, f"{param}: the prompt has {tokens} image placeholder tokens for {images} images "
                                 "(one placeholder per image)")


def _runs(ids: list[int], token: int) -> list[tuple[int, int]]:
    """(start, length) of each run of `token` in ids."""
    runs: list[tuple[int, int]] = []
    for k, t in enumerate(ids):
        if t == token:
            if k and ids[k - 1] == token:
                runs[-1] = (runs[-1][0], runs[-1][1] + 1)
            else:
                runs.append((k, 1))
    return runs


def _check_idefics3_processor(path: str, processor, cfg) -> None:
    """The saved processor must make the crops the model's image-token count is for: a crop is
    (image_size / patch_size / scale_factor)² tokens, so crops of the tower's image_size (`max_image_size`)
    and that many `<image>` per crop in the prompt (`image_seq_len`); otherwise refused at load, naming the field."""
    from pagedserve.model.families import UnsupportedModelError
    side = (getattr(processor, "max_image_size", None) or {}).get("longest_edge")
    if side != cfg.image_size or not hasattr(processor, "split_images"):
        raise UnsupportedModelError(f"{path}: the image processor's max_image_size {side} is not the vision tower's "
                                    f"image_size {cfg.image_size} (or it is not an Idefics3 image processor: "
                                    f"{type(processor).__name__})")
    try:
        with open(os.path.join(path, "processor_config.json")) as f:
            seq = json.load(f).get("image_seq_len", cfg.image_seq_len)
    except FileNotFoundError:
        seq = cfg.image_seq_len
    if seq != cfg.image_seq_len:
        raise UnsupportedModelError(f"{path}: processor_config.json image_seq_len {seq} differs from the model's "
                                    f"{cfg.image_seq_len} vectors per crop")


def _check_gemma3_processor(path: str, processor, cfg) -> None:
    """The saved processor must make the tower's square images and write mm_tokens_per_image image tokens
    per image, without pan-and-scan crops (not implemented); otherwise refused at load, naming the field."""
    from pagedserve.model.families import UnsupportedModelError
    size = getattr(processor, "size", None) or {}
    if (size.get("height"), size.get("width")) != (cfg.image_size, cfg.image_size):
        raise UnsupportedModelError(f"{path}: the image processor's size {size} is not the vision tower's "
                                    f"{cfg.image_size} x {cfg.image_size} (vision_config.image_size)")
    if getattr(processor, "do_pan_and_scan", None):
        raise UnsupportedModelError(f"{path}: the image processor's do_pan_and_scan (extra crops per image) is not "
                                    "implemented")
    try:
        with open(os.path.join(path, "processor_config.json")) as f:
            seq = json.load(f).get("image_seq_length", cfg.image_seq_len)
    except FileNotFoundError:
        seq = cfg.image_seq_len
    if seq != cfg.image_seq_len:
        raise UnsupportedModelError(f"{path}: processor_config.json image_seq_length {seq} differs from the model's "
                                    f"mm_tokens_per_image {cfg.image_seq_len}")


def check_image(img, param: str):
    """An offline image (a PIL image) -> RGB, its size checked."""
    from PIL import Image
    if not isinstance(img, Image.Image):
        raise ParamError(param, f"{param}: an image must be a PIL.Image.Image, got {type(img).__name__}")
    _check_pixels(img, param)
    return img if img.mode == "RGB" else img.convert("RGB")


def split_image_parts(contents: list, images: ImageInputs | None) -> tuple[list, list[tuple[str, str]]]:
    """Chat messages' contents (in order) with their `image_url` parts taken out: a message with images
    becomes one string, its model's placeholder ("<image>\\n" each, before its text, as vLLM writes them for templates
    of string content), and their URLs come back in order with the field naming each. Refused (naming the
    part) for a text-only model, or beyond the per-prompt limit, before any image is decoded."""
    out, urls = [], []
    for k, content in enumerate(contents):
        if not isinstance(content, list) or not any(isinstance(p, dict) and p.get("type") == "image_url"
                                                    for p in content):
            out.append(content)
            continue
        texts, n = [], 0
        for i, p in enumerate(content):
            param = f"messages[{k}].content[{i}]"
            if p.get("type") == "text":
                texts.append(str(p.get("text", "")))
                continue
            if p.get("type") != "image_url":
                raise ParamError(param, f"{param}: content part type {p.get('type')!r} is not supported (text and "
                                        "image_url)")
            param += ".image_url"
            if images is None:
                raise ParamError(param, f"{param}: this model takes no images (a text-only model)")
            ref = p.get("image_url")
            url = ref.get("url") if isinstance(ref, dict) else ref
            if not isinstance(url, str):
                raise ParamError(param, f"{param}: must be {{\"url\": \"data:image/...;base64,...\"}}")
            urls.append((url, param + ".url"))
            n += 1
        if len(urls) > images.limit:        # (before any image is decoded, or the next message read)
            raise ParamError("messages", f"messages: more than {images.limit} images in the prompt "
                                         "(--limit-mm-per-prompt)")
        out.append(images.chat_placeholder * n + "".join(texts))
    return out, urls
