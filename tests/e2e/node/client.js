// A headrace client in Node, built only from the .proto files: proof that any gRPC language
// can stream from headrace.
//
//   node client.js TARGET PROMPT MAX_TOKENS [--one] [--chat] [--tls-ca PEM]
//                  [--tls-cert PEM --tls-key PEM] [--api-key KEY] [--config JSON]
//
// Sends one greedy request (ignore_eos) on a bidirectional `Generate` stream, or with --one
// on the server-streaming `GenerateOne` (without a request_id: the server assigns one), and
// prints each chunk as one JSON line. --chat sends the prompt as one user message of a
// conversation, which the server renders with the model's chat template. --tls-ca speaks
// TLS trusting that CA, --tls-cert and --tls-key present a client certificate (mTLS),
// --api-key sends `authorization: Bearer`. --config adds GenerationConfig fields, named as in
// the .proto (e.g. {"json_schema": "...", "choice": ["a"], "logit_bias": {"9": 100}}, or a beam
// search: {"num_beams": 3, "n": 2, "early_stopping": "never"}). A chunk's optional
// cumulative_logprob and beam_score (a beam's) print as null when unset.
// Exits 1 with the status on stderr if the RPC or the request fails.
'use strict';

const fs = require('fs');
const path = require('path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const PROTO_ROOT = path.resolve(__dirname, '..', '..', '..', 'protos');

function loadGeneration() {
  const definition = protoLoader.loadSync('headrace/v1/generation.proto', {
    includeDirs: [PROTO_ROOT],
    keepCase: true, // field names as in the .proto (request_id, token_ids, ...)
    longs: Number, // int64 token ids and counts fit a double
    enums: String, // finish_reason as its name, e.g. FINISH_REASON_LENGTH
    defaults: true,
    oneofs: true,
  });
  return grpc.loadPackageDefinition(definition).headrace.v1;
}

function printChunk(chunk) {
  if (chunk.error) {
    throw new Error(`request failed: code ${chunk.error.code}: ${chunk.error.message}`);
  }
  const { request_id, index, token_ids, text, finish_reason, finished } = chunk;
  // proto3 optional fields: absent from the decoded object when unset.
  const cumulative_logprob = chunk.cumulative_logprob ?? null;
  const beam_score = chunk.beam_score ?? null;
  const line = { request_id, index, token_ids, text, finish_reason, finished };
  console.log(JSON.stringify({ ...line, cumulative_logprob, beam_score }));
  return finished;
}

function fail(error) {
  console.error(error.message || String(error));
  process.exit(1);
}

function parseArgs(argv) {
  const [target, prompt, maxTokens, ...rest] = argv;
  if (!target || !prompt || !maxTokens) fail(new Error('usage: client.js TARGET PROMPT MAX_TOKENS [flags]'));
  const options = { target, prompt, maxTokens: Number(maxTokens), one: false };
  for (let i = 0; i < rest.length; i += 1) {
    const flag = rest[i];
    if (flag === '--one') options.one = true;
    else if (flag === '--chat') options.chat = true;
    else if (['--tls-ca', '--tls-cert', '--tls-key', '--api-key', '--config'].includes(flag)) options[flag] = rest[++i];
    else fail(new Error(`unknown flag ${flag}`));
  }
  return options;
}

function credentials(options) {
  if (!options['--tls-ca']) return grpc.credentials.createInsecure();
  const read = (flag) => (options[flag] ? fs.readFileSync(options[flag]) : null);
  return grpc.credentials.createSsl(read('--tls-ca'), read('--tls-key'), read('--tls-cert'));
}

function metadata(options) {
  const metadata = new grpc.Metadata();
  if (options['--api-key']) metadata.add('authorization', `Bearer ${options['--api-key']}`);
  return metadata;
}

function main() {
  const options = parseArgs(process.argv.slice(2));
  const v1 = loadGeneration();
  const client = new v1.Generation(options.target, credentials(options));
  const request = {
    config: {
      max_tokens: options.maxTokens,
      temperature: 0,
      ignore_eos: true,
      ...JSON.parse(options['--config'] || '{}'),
    },
  };
  if (options.chat) request.chat = { messages: [{ role: 'user', content: options.prompt }] };
  else request.text = options.prompt;
  if (!options.one) request.request_id = 'node-1'; // only a multiplexed stream needs one
  const call = options.one
    ? client.GenerateOne(request, metadata(options))
    : client.Generate(metadata(options));
  call.on('data', (response) => {
    try {
      for (const chunk of response.chunks) {
        // On the bidi stream, half-close once our request is done: the server then ends it.
        if (printChunk(chunk) && !options.one) call.end();
      }
    } catch (error) {
      fail(error);
    }
  });
  call.on('error', fail);
  call.on('end', () => client.close());
  if (!options.one) call.write({ request });
}

main();
