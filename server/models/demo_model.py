"""The demo model: a tiny random-weight Llama folder (config, safetensors, BPE tokenizer, chat
template) that pagewire can serve and test against with no download.

`ensure_demo_model()` builds it once into the user cache and re-uses it after; `build_tokenizer()`
writes just the tokenizer files, so tests can pair it with their own tiny models. Weights and
tokenizer are deterministic (fixed seed, fixed corpus), so two builds give identical folders.
This module must not import transformers (a test-only dependency), and imports torch only to
write the weights: `build_tokenizer` runs where torch is not installed (the torch-free edge suite
on Python 3.10, `make test-py310`).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, Optional

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

if TYPE_CHECKING:
    import torch

DEMO_MODEL_NAME = "demo-model-v1"  # bump the suffix whenever the folder's contents change
BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, IM_START, IM_END)
DEFAULT_VOCAB_SIZE = 2000
WEIGHT_SEED = 1234

# ChatML with an optional tools block. Message content may be a string or a list of OpenAI-style
# parts, of which only the text parts are rendered.
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if tools %}"
    "{{- '<|im_start|>system\\nYou may call these tools by answering with a JSON object "
    "{\"name\": ..., \"arguments\": {...}}.\\n' }}"
    "{%- for tool in tools %}{{- tool | tojson }}{{- '\\n' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- elif message['content'] is defined %}"
    "{%- for part in message['content'] %}{%- if part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Original prose written for this project (no copied text). Paragraphs are separated by blank
# lines; wrapped lines inside a paragraph are re-joined with single spaces before training.
_CORPUS = """\
The lighthouse on the northern point has not needed a keeper for thirty years, yet every evening
a woman named Ilse climbs its spiral stairs anyway. She says the lamp turns itself on, but
somebody ought to watch it do so. From the gallery she can count the fishing boats returning,
note which ones ride low with a good catch, and guess which families will eat well tonight. The
wind up there smells of salt and diesel and, when the tide is out, of warm seaweed drying on the
rocks.

Baking bread at home is mostly a lesson in patience. You mix flour, water, salt and a little
yeast, then you wait while nothing seems to happen. The dough sits in its bowl like a sleeping
animal. Hours later it has doubled, soft and full of small bubbles, and you fold it gently so
that the gas is spread through the whole loaf. A hot oven does the rest. The crust crackles as
it cools, which bakers call singing, and the kitchen fills with a smell that no candle has ever
managed to copy.

Every morning the first train leaves the valley station at six minutes past five. It carries
nurses going to the early shift, students who missed the last bus home, and a few tired
musicians still holding their instrument cases. The conductor knows most of them by name. He
punches their tickets with the same steady rhythm he has used for two decades, and he always
announces the stops a little too loudly, as if the passengers might otherwise forget where they
live.

A small garden can teach you more about weather than any forecast. Tomatoes sulk when the nights
turn cold, beans climb faster after a thunderstorm, and the lettuce bolts the moment summer
arrives in earnest. Gardeners learn to read the sky the way sailors do: a ring around the moon,
swallows flying low, the particular heavy stillness before rain. None of these signs is
perfectly reliable, but together they make a kind of language, and after a few seasons you begin
to speak it without thinking.

Computers that answer questions in plain language are built from surprisingly simple parts. A
model reads a sequence of tokens, which are small pieces of words, and predicts which token
should come next. It repeats this again and again, one step at a time, until it writes a special
token that means the answer is finished. Serving such a model well is mostly about bookkeeping:
keeping many conversations in memory at once, sharing work between requests that begin the same
way, and never making a user wait longer than necessary.

The library in our town occupies an old grain warehouse beside the canal. Its floors still tilt
slightly toward the water, so a marble dropped near the poetry shelves will roll all the way to
the maps. Children test this constantly. The librarians pretend not to notice. On rainy
afternoons the reading room is crowded with people who came in to stay dry and stayed for the
books, and the radiators tick and hum like a second, quieter clock.

Climbing a mountain is rarely dramatic. It is a long series of ordinary steps, most of them
uphill, interrupted by sandwiches. The summit matters less than people imagine; what stays with
you is the hour before dawn when the headlamps of other climbers make a thin bright chain across
the glacier, and the cold is so clean that breathing feels like drinking water. Coming down is
harder on the knees and easier on the heart.

My neighbour repairs clocks in a workshop no larger than a wardrobe. He keeps hundreds of tiny
screws sorted in glass jars, each jar labelled in handwriting that only he can read. When a
customer brings in a silent clock, he listens to it first, holding it close to his ear as if it
might whisper the problem. Usually the trouble is dust, or a spring that has grown tired.
Occasionally it is something stranger, a moth that crawled inside and made the gears its home.

Rivers are patient engineers. Over thousands of years they carve valleys, move mountains one
grain at a time, and build wide fertile plains from the mud they carry. A river in flood looks
angry, but it is only following the simplest rule it knows: water goes downhill, by the shortest
path it can find. Towns that forget this rule tend to be reminded of it, usually in spring,
usually at night.

The market opens on Saturdays at seven. Farmers arrive earlier, unloading crates of apples,
potatoes, honey, cheese and eggs while the square is still blue with shadow. By eight the coffee
stall has a queue, the flower seller is arguing cheerfully with the fishmonger, and a dog has
stolen at least one sausage. Prices are written on small chalkboards, and the numbers change as
the morning goes on: strawberries cost four euros at nine and two at noon.

Learning a new language as an adult is humbling. You spend months sounding like a polite child,
asking for directions you do not understand and nodding at jokes you cannot follow. Then one day
you dream in the new language, or you laugh at the right moment without translating first, and
you realise that a door has opened quietly behind you. The grammar book never mentioned that
part. It only listed verbs.

Winter in the north arrives in stages. First the birch leaves turn yellow and fall in a single
windy week. Then the lakes grow a thin skin of ice at the edges, clear as glass, which breaks if
you look at it too hard. Snow comes next, light at first, then heavy and serious. By midwinter
the sun barely rises at all, and people fill their windows with candles and stars made of paper,
as if to remind the darkness that someone is still at home.

An orchestra tuning before a concert makes a sound unlike any other. The oboe plays a single
steady note, and gradually every instrument leans toward it, violins and cellos and horns, until
the whole hall seems to hum one enormous chord. Then silence. The conductor lifts both hands. In
that pause, before the first bar, everything is possible, and the audience holds its breath
together like one large careful animal.

Good software, like good furniture, shows its quality in the joints. Anyone can make a table
that looks fine in a photograph; the real test is whether it wobbles after a year of daily use.
Programs are the same. Clear names, small functions, honest error messages and tests that
describe behaviour rather than implementation are the dovetails and mortises of the craft. They
are invisible to most users, who simply notice that nothing breaks.

Tea tastes different in every country that drinks it. In one place it is brewed strong and dark
and sweetened heavily with sugar and milk; in another it is pale green and bitter, served in
tiny cups without handles; somewhere else it is mixed with butter and salt and drunk to keep out
the mountain cold. The leaf is the same plant everywhere. Only the people, the water, and the
stories told over the cups are different.

Questions and answers: What time does the museum open? It opens at ten, except on Mondays, when
it is closed. How far is the harbour from the station? About twelve minutes on foot, or three
stops by tram. Can I bring my bicycle on the ferry? Yes, but please buy a separate ticket for
it. Thank you very much! You are welcome; enjoy your visit, and do not miss the café on the top
floor.

Numbers appear everywhere once you start looking: 3 cups of flour, 12 eggs, 2024 kilometres, 7
days a week, 60 minutes in an hour, 365 days in a year, and 1,000 reasons to stay in bed on a
rainy Sunday. Lists help too: first, second, third; north, south, east, west; red, orange,
yellow, green, blue, indigo, violet. Some people prefer words, others prefer figures, and the
best writers know when each one will be clearer.

Bicycles are quietly radical machines. With two wheels, a chain and a little effort, a person
can travel four times as fast as walking while using less energy per kilometre than almost any
animal. Repairing one requires only a few spanners, a pump, some patience, and perhaps a bucket
of water to find the puncture by watching for bubbles. Children remember the afternoon they
first rode without help for the rest of their lives, usually along with a scraped knee.

The old ferry captain keeps a notebook of every crossing she has made: the date, the wind, the
height of the swell, and one sentence about the passengers. Some entries are dull. Others are
wonderful: a wedding party singing in the rain, a goat that escaped on deck, a boy who saw
dolphins and could not stop shouting. She says the notebook is for the insurance company. Nobody
believes her, least of all the insurance company.

Thunderstorms build on hot afternoons when warm, damp air rises quickly into colder air above.
Towering clouds swell upward, flattening at the top into the shape of an anvil, and inside them
ice and water collide until enough electric charge separates to jump as lightning. Counting the
seconds between flash and thunder, then dividing by three, gives a rough distance in kilometres.
Dogs, being sensible, usually hide under the bed long before anyone has finished counting.
"""


class TokenizerInfo(NamedTuple):
    """What a model config needs from the demo tokenizer."""

    vocab_size: int
    bos_token_id: int
    eos_token_id: int  # <|end_of_text|>; generation_config also lists <|im_end|>
    eos_token_ids: tuple[int, ...]


def _corpus_paragraphs() -> list[str]:
    return [" ".join(p.split("\n")) for p in _CORPUS.strip().split("\n\n")]


def build_tokenizer(out_dir: str | Path, vocab_size: int = DEFAULT_VOCAB_SIZE) -> TokenizerInfo:
    """Train the demo byte-level BPE tokenizer and write tokenizer.json, tokenizer_config.json,
    special_tokens_map.json and generation_config.json into `out_dir` (created if needed).

    Args:
        out_dir: destination folder; existing files of the same names are overwritten.
        vocab_size: target vocabulary including the 4 special tokens; the small corpus may stop
            short of very large targets, so use the returned `vocab_size`.
    Returns:
        TokenizerInfo with the real vocabulary size and the special token ids.
    """
    minimum = 256 + len(SPECIAL_TOKENS)
    if vocab_size < minimum:
        raise ValueError(f"vocab_size must be at least {minimum} (bytes + specials), got {vocab_size}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    # Same shape as GPT-2/Llama 3: byte-level, no prefix space, BOS added by the post-processor.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus_paragraphs(), trainer)
    bos_id = tok.token_to_id(BOS_TOKEN)
    eos_id = tok.token_to_id(EOS_TOKEN)
    im_end_id = tok.token_to_id(IM_END)
    # The trainer above added these as special tokens, so each has an id.
    assert bos_id is not None and eos_id is not None and im_end_id is not None
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN}:1 $B:1",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    tok.save(str(out / "tokenizer.json"))
    added = {
        str(tok.token_to_id(t)): {
            "content": t, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 2048,
        "added_tokens_decoder": added,
        "extra_special_tokens": [IM_START, IM_END],
        "chat_template": CHAT_TEMPLATE,
    }
    _write_json(out / "tokenizer_config.json", config)
    specials_map = {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": EOS_TOKEN}
    _write_json(out / "special_tokens_map.json", specials_map)
    eos_ids = (eos_id, im_end_id)
    _write_json(out / "generation_config.json", {"bos_token_id": bos_id, "eos_token_id": list(eos_ids)})
    return TokenizerInfo(tok.get_vocab_size(), bos_id, eos_id, eos_ids)


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def demo_config(info: TokenizerInfo) -> dict:
    """config.json contents (transformers 5 style: rope settings under `rope_parameters`)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": info.vocab_size,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 32,
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": info.bos_token_id,
        "eos_token_id": list(info.eos_token_ids),
        "pad_token_id": None,
        "dtype": "float32",
        "transformers_version": "5.0.0",
    }


def _random_weights(config: dict, seed: int) -> dict[str, "torch.Tensor"]:
    """HF-named float32 tensors. Linear weights use std 1/sqrt(fan_in) so activations keep unit
    scale: attention then has real structure (not uniform) and logits spread to std ~3, which
    keeps greedy argmax margins well above float32 noise when implementations are compared.
    Norm weights sit near (not at) 1 so a loader that ignores them is caught."""
    import torch  # here, not at the top: build_tokenizer must import without torch

    g = torch.Generator().manual_seed(seed)
    h, inter, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    hd = config["head_dim"]
    q_out, kv_out = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd

    def linear(out_f: int, in_f: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(out_f, in_f, generator=g) * (scale / in_f**0.5)

    def norm() -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(h, generator=g)

    w: dict[str, torch.Tensor] = {"model.embed_tokens.weight": torch.randn(v, h, generator=g)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = linear(q_out, h)
        w[p + "self_attn.k_proj.weight"] = linear(kv_out, h)
        w[p + "self_attn.v_proj.weight"] = linear(kv_out, h)
        w[p + "self_attn.o_proj.weight"] = linear(h, q_out)
        w[p + "mlp.gate_proj.weight"] = linear(inter, h)
        w[p + "mlp.up_proj.weight"] = linear(inter, h)
        w[p + "mlp.down_proj.weight"] = linear(h, inter)
        w[p + "input_layernorm.weight"] = norm()
        w[p + "post_attention_layernorm.weight"] = norm()
    w["model.norm.weight"] = norm()
    w["lm_head.weight"] = linear(v, h, scale=3.0)
    return {k: t.contiguous() for k, t in w.items()}


def default_cache_dir() -> Path:
    """The folder that holds demo-model-v1: platformdirs' user cache dir for pagewire."""
    import platformdirs  # imported lazily: only the demo path needs it

    return Path(platformdirs.user_cache_dir("pagewire"))


def ensure_demo_model(cache_dir: Optional[Path] = None) -> Path:
    """Return the demo model folder `<cache_dir>/demo-model-v1`, building it first if absent.

    Args:
        cache_dir: parent folder; default `default_cache_dir()`.
    Returns:
        Path of a complete model folder (config.json, model.safetensors, tokenizer files).

    The folder is built in a temporary sibling and renamed into place, so a reader never sees a
    half-written model and two processes racing to build it both end with one complete folder.
    """
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = root / DEMO_MODEL_NAME
    if (final / "config.json").is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{DEMO_MODEL_NAME}-", dir=root))
    try:
        info = build_tokenizer(tmp)
        config = demo_config(info)
        _write_json(tmp / "config.json", config)
        weights = _random_weights(config, WEIGHT_SEED)
        from safetensors.torch import save_file

        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        try:
            os.rename(tmp, final)
        except OSError:
            # Another process renamed its complete copy first (the target now exists): use that one.
            if not (final / "config.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final
