// odmoe's OpenAI-compatible HTTP API through the official `openai` JavaScript SDK (the version pinned in
// package-lock.json, maxRetries: 0): a loopback cluster (`odmoe cluster up`: main with http_address and two
// workers) serving ../shared/models/tiny-mixtral-kjv; a completion, a chat, streaming (the streamed text equals
// the whole answer for the same seed), JSON mode, a JSON Schema read back by beta.chat.completions.parse, vLLM's
// guided_regex passed through the SDK as an extra field, the model list, and a 400 and a 404 surfaced as the SDK's
// BadRequestError and NotFoundError. Run by tests/http/run_js_tests.sh (ctest http_openai_sdk), which sets
// ODMOE_BINARY_DIR and ODMOE_SHARED_DIR.
import { after, before, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';
import fs from 'node:fs';
import net from 'node:net';
import os from 'node:os';
import path from 'node:path';
import OpenAI from 'openai';

const MODEL = 'tiny-mixtral-kjv';
const binaryDir = process.env.ODMOE_BINARY_DIR ?? path.resolve('build');
const modelDir = path.join(process.env.ODMOE_SHARED_DIR ?? path.resolve('../shared'), 'models', MODEL);
const odmoe = path.join(binaryDir, 'bin', 'odmoe');
const haveModel = fs.existsSync(path.join(modelDir, 'config.json'));

// A TCP port on 127.0.0.1 that was free a moment ago, drawn below the kernel's ephemeral range (as
// tests/test_support.h's PickFreePorts): a port 0 listen, or another test's outgoing connection, hands out ports
// from that range, which another process may take before our cluster binds it.
function tryListen(port) {
  return new Promise((resolve) => {
    const server = net.createServer();
    server.once('error', () => resolve(false));
    server.listen(port, '127.0.0.1', () => server.close(() => resolve(true)));
  });
}
const taken = new Set();
async function freePort() {
  let low = 32768;
  try {
    low = Number(fs.readFileSync('/proc/sys/net/ipv4/ip_local_port_range', 'utf8').trim().split(/\s+/)[0]) || low;
  } catch {}
  for (let tries = 0; tries < 10000; ++tries) {
    const port = 10000 + Math.floor(Math.random() * (low - 10000));
    if (!taken.has(port) && (await tryListen(port))) {
      taken.add(port);
      return port;
    }
  }
  throw new Error('no free port below the ephemeral range');
}

describe(`the OpenAI SDK against a cluster serving ${MODEL}`, { skip: haveModel ? false : `${modelDir} is missing` }, () => {
  let dir;
  let config;
  let client;

  before(async () => {
    dir = fs.mkdtempSync(path.join(os.tmpdir(), 'odmoe-http-js-'));
    const [main, w0, w1, http] = [await freePort(), await freePort(), await freePort(), await freePort()];
    config = path.join(dir, 'cluster.toml');
    fs.writeFileSync(config, [
      '[cluster]', 'name = "http-js"', 'group_size = 2', 'rpc_timeout_ms = 20000', 'startup_timeout_ms = 60000',
      '[model]', `path = "${modelDir}"`, '[shadow]', 'mode = "none"',
      '[[node]]', 'name = "main"', 'role = "main"', `address = "127.0.0.1:${main}"`, 'device = "cpu"',
      `http_address = "127.0.0.1:${http}"`,
      '[[node]]', 'name = "w0"', 'role = "worker"', `address = "127.0.0.1:${w0}"`, 'device = "mock-gpu"',
      '[[node]]', 'name = "w1"', 'role = "worker"', `address = "127.0.0.1:${w1}"`, 'device = "mock-gpu"', '',
    ].join('\n'));
    const up = execFileSync(odmoe, ['cluster', 'up', '--config', config, '--run-dir', path.join(dir, 'run')],
      { encoding: 'utf8' });
    assert.match(up, new RegExp(`\\nhttp: 127\\.0\\.0\\.1:${http}\\n`));
    client = new OpenAI({ baseURL: `http://127.0.0.1:${http}/v1`, apiKey: 'unused', maxRetries: 0, timeout: 60000 });
  });

  after(() => {
    if (config) {
      execFileSync(odmoe, ['cluster', 'down', '--config', config, '--run-dir', path.join(dir, 'run')]);
    }
    if (dir) fs.rmSync(dir, { recursive: true, force: true });
  });

  test('lists the model', async () => {
    const models = await client.models.list();
    assert.deepEqual(models.data.map((m) => m.id), [MODEL]);
  });

  test('completion', async () => {
    const c = await client.completions.create({ model: MODEL, prompt: 'And God said', max_tokens: 8, temperature: 0 });
    assert.equal(c.object, 'text_completion');
    assert.equal(c.choices.length, 1);
    assert.equal(typeof c.choices[0].text, 'string');
    assert.ok(c.choices[0].text.length > 0);
    assert.ok(['stop', 'length'].includes(c.choices[0].finish_reason));
    assert.ok(c.usage.prompt_tokens > 0);
    assert.ok(c.usage.completion_tokens > 0 && c.usage.completion_tokens <= 8);
    assert.equal(c.usage.total_tokens, c.usage.prompt_tokens + c.usage.completion_tokens);
  });

  test('chat', async () => {
    const c = await client.chat.completions.create({
      model: MODEL,
      messages: [{ role: 'system', content: 'Answer from the Bible.' }, { role: 'user', content: 'Who made light?' }],
      max_tokens: 8,
      temperature: 0,
    });
    assert.equal(c.object, 'chat.completion');
    assert.equal(c.choices[0].message.role, 'assistant');
    assert.equal(typeof c.choices[0].message.content, 'string');
    assert.ok(['stop', 'length'].includes(c.choices[0].finish_reason));
  });

  test('streamed completion equals the whole one for the same seed', async () => {
    const params = { model: MODEL, prompt: 'In the beginning', max_tokens: 20, temperature: 0.8, seed: 5 };
    const whole = await client.completions.create(params);
    const stream = await client.completions.create({ ...params, stream: true, stream_options: { include_usage: true } });
    let text = '';
    let finish = null;
    let usage = null;
    let chunks = 0;
    for await (const chunk of stream) {
      chunks += 1;
      for (const choice of chunk.choices) {
        text += choice.text;
        if (choice.finish_reason) finish = choice.finish_reason;
      }
      if (chunk.usage) usage = chunk.usage;
    }
    assert.ok(chunks > 2, `${chunks} chunks`);
    assert.equal(text, whole.choices[0].text);
    assert.equal(finish, whole.choices[0].finish_reason);
    assert.deepEqual(usage, whole.usage);
  });

  test('streamed chat equals the whole one for the same seed', async () => {
    const params = {
      model: MODEL, messages: [{ role: 'user', content: 'Tell of Noah.' }], max_tokens: 16, temperature: 0.7, seed: 9,
    };
    const whole = await client.chat.completions.create(params);
    const stream = await client.chat.completions.create({ ...params, stream: true });
    let text = '';
    let role = null;
    for await (const chunk of stream) {
      const delta = chunk.choices[0]?.delta ?? {};
      if (delta.role) role = delta.role;
      text += delta.content ?? '';
    }
    assert.equal(role, 'assistant');
    assert.equal(text, whole.choices[0].message.content);
  });

  test("chat logprobs: the SDK's stream helper assembles the streamed ones into the whole answer's", async () => {
    const params = {
      model: MODEL, messages: [{ role: 'user', content: 'Who made light?' }], max_tokens: 8, temperature: 0,
      logprobs: true, top_logprobs: 3,
    };
    const whole = await client.chat.completions.create(params);
    const content = whole.choices[0].logprobs.content;
    assert.equal(content.length, whole.usage.completion_tokens);
    for (const t of content) {
      assert.equal(typeof t.token, 'string');
      assert.ok(t.logprob <= 0, String(t.logprob));
      assert.ok(Array.isArray(t.bytes));
      assert.equal(t.top_logprobs.length, 3);
      assert.equal(t.top_logprobs[0].logprob, t.logprob, 'greedy picks the likeliest');
    }
    const streamed = await client.beta.chat.completions.stream(params).finalChatCompletion();
    assert.deepEqual(streamed.choices[0].logprobs.content, content);
  });

  test("n choices: the SDK's stream helper assembles the interleaved chunks into the whole answer's", async () => {
    const params = {
      model: MODEL, messages: [{ role: 'user', content: 'Tell of Noah.' }], max_tokens: 10, temperature: 0.9, seed: 3,
      n: 3,
    };
    const whole = await client.chat.completions.create(params);
    assert.equal(whole.choices.length, 3);
    assert.deepEqual(whole.choices.map((c) => c.index), [0, 1, 2]);
    const streamed = await client.beta.chat.completions.stream(params).finalChatCompletion();
    assert.equal(streamed.choices.length, 3);
    for (let i = 0; i < 3; i += 1) {
      assert.equal(streamed.choices[i].index, i);
      assert.equal(streamed.choices[i].message.content, whole.choices[i].message.content, `choice ${i}`);
      assert.equal(streamed.choices[i].finish_reason, whole.choices[i].finish_reason, `choice ${i}`);
    }
  });

  test("response_format json_object: the answer is one JSON object, closed at once with '}' pushed up", async () => {
    // The id of the token '}' (the last of its ids: SentencePiece puts a bare space before it).
    const tokenized = await (await fetch(new URL('/tokenize', client.baseURL), {
      method: 'POST', headers: { 'Content-Type': 'application/json' },
      body: JSON.stringify({ prompt: '}', add_special_tokens: false }),
    })).json();
    const close = tokenized.tokens.at(-1);
    const params = {
      model: MODEL, messages: [{ role: 'user', content: 'The ark, as JSON.' }], max_tokens: 48, temperature: 0,
      response_format: { type: 'json_object' },
    };
    const closed = await client.chat.completions.create({ ...params, logit_bias: { [close]: 100 } });
    assert.equal(closed.choices[0].finish_reason, 'stop');
    assert.deepEqual(JSON.parse(closed.choices[0].message.content), {});
    const free = await client.chat.completions.create({ ...params, temperature: 0.8, seed: 2 });
    const text = free.choices[0].message.content;
    assert.match(text, /^\s*\{/);
    if (free.choices[0].finish_reason === 'stop') assert.equal(typeof JSON.parse(text), 'object', text);
  });

  test('response_format json_schema: beta.chat.completions.parse reads the answer as an object of the schema',
    async () => {
      const cities = ['Jerusalem', 'Babylon', 'Egypt'];
      const schema = {
        type: 'object',
        properties: {
          name: { type: 'string', maxLength: 20 },
          age: { type: 'integer', minimum: 0, maximum: 120 },
          city: { enum: cities },
        },
        required: ['name', 'age', 'city'],
        additionalProperties: false,
      };
      for (const temperature of [0, 1]) {
        const completion = await client.beta.chat.completions.parse({
          model: MODEL, messages: [{ role: 'user', content: 'A man of the ark, as JSON.' }], max_tokens: 400,
          temperature, seed: 4, response_format: { type: 'json_schema', json_schema: { name: 'person', strict: true, schema } },
        });
        const choice = completion.choices[0];
        assert.equal(choice.finish_reason, 'stop', choice.message.content);
        const person = choice.message.parsed;
        assert.deepEqual(Object.keys(person), ['name', 'age', 'city'], choice.message.content);
        assert.ok(Number.isInteger(person.age) && person.age >= 0 && person.age <= 120, choice.message.content);
        assert.ok(cities.includes(person.city), choice.message.content);
        assert.ok([...person.name].length <= 20, choice.message.content);
      }
      const unsupported = { type: 'object', properties: { code: { type: 'string', pattern: '^(?![A-Z]+$)' } } };
      await assert.rejects(client.chat.completions.create({
        model: MODEL, messages: [{ role: 'user', content: 'x' }],
        response_format: { type: 'json_schema', json_schema: { name: 'code', schema: unsupported } },
      }), (err) => {
        assert.ok(err instanceof OpenAI.BadRequestError, String(err));
        assert.equal(err.param, 'response_format');
        assert.match(err.message, /at '\/properties\/code': 'pattern' at character 3: lookarounds are not supported/);
        return true;
      });
    });

  test('guided_regex, an extra field the SDK sends as it is: the whole answer matches the expression', async () => {
    const regex = '(?P<who>[A-Z][a-z]{1,8}) (said|spake) unto [A-Z][a-z]{1,8}\\.';
    const whole = /^[A-Z][a-z]{1,8} (said|spake) unto [A-Z][a-z]{1,8}\.$/;
    for (const temperature of [0, 1]) {
      const completion = await client.chat.completions.create({
        model: MODEL, messages: [{ role: 'user', content: 'Who spoke?' }], max_tokens: 64, temperature, seed: 3,
        guided_regex: regex,
      });
      const choice = completion.choices[0];
      assert.equal(choice.finish_reason, 'stop', choice.message.content);
      assert.match(choice.message.content, whole);
    }
  });

  test('a bad parameter is a BadRequestError', async () => {
    await assert.rejects(client.completions.create({ model: MODEL, prompt: 'x', n: 0 }), (err) => {
      assert.ok(err instanceof OpenAI.BadRequestError, String(err));
      assert.equal(err.status, 400);
      assert.equal(err.param, 'n');
      assert.equal(err.type, 'invalid_request_error');
      return true;
    });
  });

  test('an unknown model is a NotFoundError', async () => {
    await assert.rejects(client.chat.completions.create({ model: 'gpt-4o', messages: [{ role: 'user', content: 'x' }] }),
      (err) => {
        assert.ok(err instanceof OpenAI.NotFoundError, String(err));
        assert.equal(err.status, 404);
        assert.equal(err.code, 'model_not_found');
        return true;
      });
  });
});
