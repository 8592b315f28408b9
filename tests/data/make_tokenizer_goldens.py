"""Generate tests/data/tokenizer_goldens.json once: golden ids for the Qwen3.5 vocabulary (issue 3).

Two reference encoders, both built here from the GGUF read with gguf-py's GGUFReader (not engine.gguf), and
both independent of engine/text/tokenizer.py; the script stops if they disagree on any string:
  1. transformers' PreTrainedTokenizerFast around a `tokenizers` pipeline assembled through the Python API
     (models.BPE from merge tuples, NFC, Split + ByteLevel pre-tokenizers, AddedToken objects) following
     fixtures/README.md "Building a reference tokenizer from the GGUF";
  2. a plain-Python merges-only BPE (the `regex` module for the split, lowest merge rank first).
Lone surrogates cannot be UTF-8: both references get the text with each lone surrogate replaced by U+FFFD,
the engine's documented rule. Run: .venv/bin/python tests/data/make_tokenizer_goldens.py [GGUF]
"""

from __future__ import annotations

import json
import sys
import unicodedata
from pathlib import Path

import regex
from gguf import GGUFReader

HERE = Path(__file__).resolve().parent
DEFAULT_GGUF = HERE.parent.parent.parent / "shared" / "fixtures" / "tokenizer" / "qwen35-vocab.gguf"
OUT = HERE / "tokenizer_goldens.json"
SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
         r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def strings() -> list[tuple[str, str]]:
    s: list[tuple[str, str]] = []
    prose = [
        "Hello world", "Hello, world!", "The quick brown fox jumps over the lazy dog.",
        "It's a test; don't panic, we'll see what they've done and I'd say you're right.",
        "I'M SHOUTING AND IT'S LOUD", "Mr. O'Neil's dog's bone", "e.g. i.e. etc. U.S.A.",
        "A sentence with trailing space ", " leading space", "  two leading spaces", "tab\tseparated\tvalues",
        "Line one\nLine two\r\nLine three\rLine four", "end with newline\n", "\n\nstarts with two newlines",
        "Supercalifragilisticexpialidocious", "antidisestablishmentarianism", "naïve café résumé coöperate",
        "Ünïcödé àccènts everywhere", "Straße Größe Maß", "¿Dónde está la biblioteca? ¡Aquí!",
        "Il était une fois, dans un château très ancien…", "«Guillemets» and “smart quotes” and ‘single’",
        "em—dash en–dash hyphen-minus", "a", "", " ", "Ab", "AB", "ab cd ef gh ij kl mn op qr st uv wx yz",
    ]
    s += [("prose", t) for t in prose]
    code = [
        "def f(x):\n    return x ** 2\n", "for (int i = 0; i < n; ++i) { sum += a[i]; }",
        "const x = {a: 1, b: [2, 3], 'c': \"d\"};", "#include <stdio.h>\nint main(void) { return 0; }",
        "SELECT id, name FROM users WHERE age >= 18 ORDER BY name DESC;",
        "if __name__ == \"__main__\":\n\tmain()", "x=>x*2; y != z && w || !v", "<div class=\"a\">&amp;</div>",
        "    indented four\n        indented eight", "fn main() -> Result<(), Box<dyn Error>> { Ok(()) }",
        "$ ls -la | grep '.py$' > out.txt 2>&1", "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}",
        "lambda *args, **kwargs: None", "a[i][j] += b[j][k] * c[k][i];", "/* comment */ // another\n# third",
        "```python\nprint('hi')\n```", "\\n \\t \\\\ escaped", "regex: ^[a-z]+(?:\\d{2,3})?$",
        "camelCaseIdentifier snake_case_identifier SCREAMING_CASE", "0x1F 0b1010 0o777 1e-9 3.14159",
    ]
    s += [("code", t) for t in code]
    numbers = ["0", "7", "42", "123", "1234", "12345678901234567890", "3.14", "-2.5e10", "1,000,000",
               "2024-01-31", "12:34:56", "+1 (555) 123-4567", "١٢٣ ٤٥٦", "१२३४", "⅓ ½ ¾", "①②③", "x²+y²=z²",
               "100%", "$19.99", "€5,00", "0.000001", "v1.2.3-rc.4", "4chan 3D 2nd 1st", "9999999999"]
    s += [("numbers", t) for t in numbers]
    ws = [" " * n for n in (1, 2, 3, 4, 7, 16, 33)] + ["\n" * n for n in (1, 2, 3, 5)] + [
        "\t", "\t\t", " \n", "\n ", " \n \n ", "a  b", "a   b", "a\n\n\nb", "a \n\n b", "a\t \tb", "\r\n\r\n",
        "x" + " " * 40 + "y", "\u00a0nbsp\u00a0", "\u3000ideographic space", "a\u2028b\u2029c", "\x0b\x0c",
        "trailing tabs\t\t\t", "\n\n\n\n\n\n\n\nend"]
    s += [("whitespace", t) for t in ws]
    cjk = ["中文", "你好，世界！", "我爱自然语言处理。", "加拿大", "人工智能正在改变世界", "繁體中文與简体中文",
           "日本語のテキストです。", "ひらがな カタカナ 漢字", "東京都渋谷区", "한국어 텍스트입니다", "안녕하세요 세계",
           "中文English混合text", "第1章　はじめに", "『引用』「括弧」【注】", "𠀀𠀁 rare CJK ext B", "龘靐齉",
           "ｆｕｌｌｗｉｄｔｈ　ＡＢＣ１２３", "漢字かなまじり文、句読点。", "中华人民共和国成立于1949年",
           "这是一个很长的句子，用于测试分词器在处理较长中文文本时的表现是否正确。"]
    s += [("cjk", t) for t in cjk]
    indic_thai = ["नमस्ते दुनिया", "हिन्दी में लिखा गया वाक्य।", "क्षत्रिय ज्ञान श्री", "प्रेम", "संस्कृतम्",
                  "বাংলা ভাষা", "தமிழ் மொழி", "తెలుగు", "ಕನ್ನಡ", "മലയാളം", "ગુજરાતી", "ਪੰਜਾਬੀ",
                  "สวัสดีครับ", "ภาษาไทยไม่มีการเว้นวรรค", "กรุงเทพมหานคร", "น้ำ ผู้ใหญ่ ที่นี่",
                  "ລາວ ພາສາ", "ភាសាខ្មែរ", "မြန်မာဘာသာ", "ཏོག་ཡིག", "e\u0301 vs \u00e9", "a\u0301\u0302\u0303",
                  "\u0301!I", "\u0301leading mark", "Zalgo: Z\u0351\u0358a\u0315\u0307l\u0351g\u0352o\u0310",
                  "Cafe\u0301 (NFD input)", "\u1100\u1161\u11a8 (Hangul jamo)", "ṩ ẛ̣ q̣̇"]
    s += [("indic_thai_marks", t) for t in indic_thai]
    emoji = ["😀", "👍🏽", "👨‍👩‍👧‍👦", "🏳️‍🌈", "🇫🇷🇯🇵", "❤️", "I ❤️ Paris 🗼", "🚀🚀🚀", "✅ done ❌ failed",
             "😂😂😂😂", "🧑🏿‍💻 codes", "⌚⌛⏰", "👋 hello 👋", "🫠", "#️⃣ *️⃣ 1️⃣", "emoji at end 🎉",
             "mixed 中文 😀 русский", "🙂🙃"]
    s += [("emoji", t) for t in emoji]
    mixed = ["Привет, мир!", "Ελληνικά γράμματα", "مرحبا بالعالم", "שלום עולם", "English עברית mixed",
             "Türkçe ğüşıöç", "Tiếng Việt có dấu", "Ქართული", "Հայերեն", "Ελληνικά and English and 中文",
             "русский123english", "αβγ δεζ", "ℵ₀ ∀x∈ℝ: x²≥0", "∑∫∂√∞≈≠≤≥", "→←↑↓⇒⇔", "©®™°±×÷",
             "ASCII then العربية then 日本語", "Ўзбек Қазақ", "Ⅻ ⅻ", "ﬁ ﬂ ligatures", "\u200bzero\u200cwidth\u200d",
             "\ufeffBOM start", "control\x01\x02\x7f chars", "\x00nul"]
    s += [("mixed", t) for t in mixed]
    added = ["<|im_start|>user\nhi<|im_end|>", "<think>\nreasoning\n</think>\n\nanswer",
             "<tool_call>\n<function=f>\n</function>\n</tool_call>", "<tool_response>\nok\n</tool_response>",
             "<|endoftext|>", "<|fim_prefix|>a<|fim_suffix|>b<|fim_middle|>", "<|vision_start|><|image_pad|>",
             "<tts_text_bos><tts_text_bos_single>", "<|audio_start|><|audio_pad|><|audio_end|>",
             "x<|im_end|>y", "<<think>>", "</think></think>", "<|im_start", "im_start|>", "<think", "think>",
             "<|IM_START|>", "< think >", "<|box_start|>(1,2)<|box_end|>", "<|repo_name|>r<|file_sep|>f"]
    s += [("added_token_text", t) for t in added]
    surrogates = ["a\ud800b", "\udfff", "x\ud83d", "\ude00y", "pair\ud83d\ude00joined", "\ud800\ud800",
                  "ok \udc80 end"]
    s += [("lone_surrogate", t) for t in surrogates]
    long_ = ["word " * 200, "中文" * 150, "ab" * 300 + "!", "😀" * 64, "a\n" * 100, "0123456789" * 30]
    s += [("long", t) for t in long_]
    return s


def clean(text: str) -> str:
    return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")


def bytes_to_unicode() -> dict[int, str]:
    bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=False)}


class PythonBPE:
    """Merges-only byte-level BPE, written for this script from the README's description."""

    def __init__(self, tokens, types, merges):
        self.vocab = {t: i for i, (t, ty) in enumerate(zip(tokens, types, strict=False)) if ty == 1}
        self.ranks = {tuple(m.split(" ")): r for r, m in enumerate(merges)}
        self.added = {t: i for i, (t, ty) in enumerate(zip(tokens, types, strict=False)) if ty in (3, 4)}
        self.control = {t for t, ty in zip(tokens, types, strict=False) if ty == 3}
        self.b2u = bytes_to_unicode()
        self.split = regex.compile(SPLIT)

    def bpe(self, word: str) -> list[int]:
        parts = list(word)
        while len(parts) > 1:
            best = min(range(len(parts) - 1), key=lambda i: self.ranks.get((parts[i], parts[i + 1]), 1 << 62))
            if (parts[best], parts[best + 1]) not in self.ranks:
                break
            parts[best:best + 2] = [parts[best] + parts[best + 1]]
        return [self.vocab[p] for p in parts]

    def encode_plain(self, text: str) -> list[int]:
        ids = []
        for piece in self.split.findall(unicodedata.normalize("NFC", text)):
            ids += self.bpe("".join(self.b2u[b] for b in piece.encode("utf-8")))
        return ids

    def encode(self, text: str, special: bool) -> list[int]:
        names = [t for t in self.added if special or t not in self.control]
        pat = regex.compile("|".join(regex.escape(t) for t in sorted(names, key=len, reverse=True)))
        ids, pos = [], 0
        for m in pat.finditer(text):
            ids += self.encode_plain(text[pos:m.start()])
            ids.append(self.added[m.group()])
            pos = m.end()
        return ids + self.encode_plain(text[pos:])


def hf_reference(tokens, types, merges):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, (t, ty) in enumerate(zip(tokens, types, strict=False)) if ty == 1}
    bpe = models.BPE(vocab=vocab, merges=[tuple(m.split(" ")) for m in merges], ignore_merges=False)
    tok = Tokenizer(bpe)
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    for i, (t, ty) in enumerate(zip(tokens, types, strict=False)):
        if ty in (3, 4):
            assert tok.get_vocab_size(with_added_tokens=True) == i, "added tokens must follow the BPE vocab"
            tok.add_tokens([AddedToken(t, special=ty == 3, normalized=False)])
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def main() -> None:
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_GGUF
    r = GGUFReader(path)

    def arr(key):
        f = r.fields[key]
        return [bytes(f.parts[i]).decode("utf-8") if f.types[1].name == "STRING" else int(f.parts[i][0])
                for i in f.data]

    tokens, types, merges = arr("tokenizer.ggml.tokens"), arr("tokenizer.ggml.token_type"), arr("tokenizer.ggml.merges")
    py = PythonBPE(tokens, types, merges)
    hf = hf_reference(tokens, types, merges)
    cases = []
    for category, text in strings():
        t = clean(text)
        plain_hf = hf(t, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        special_hf = hf(t, add_special_tokens=False, split_special_tokens=False)["input_ids"]
        plain_py, special_py = py.encode(t, special=False), py.encode(t, special=True)
        # split_special_tokens=True also splits USER_DEFINED tokens in transformers; use the Python BPE's
        # parse_special=false result for `plain` and require agreement where no USER_DEFINED text occurs.
        if not any(u in t for u in py.added if u not in py.control):
            assert plain_hf == plain_py, (category, text, plain_hf, plain_py)
        assert special_hf == special_py, (category, text, special_hf, special_py)
        cases.append({"category": category, "text": text, "ids": plain_py, "ids_special": special_py})
    OUT.write_text(json.dumps({"source": "tests/data/make_tokenizer_goldens.py", "gguf": path.name,
                               "cases": cases}, ensure_ascii=True, indent=0) + "\n")
    print(f"wrote {len(cases)} cases to {OUT}")


if __name__ == "__main__":
    main()
