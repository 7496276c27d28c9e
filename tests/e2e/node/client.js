// A headrace client in Node, built only from the .proto files: proof that any gRPC language
// can stream from headrace.
//
//   node client.js TARGET PROMPT MAX_TOKENS [--one]
//
// Sends one greedy request (ignore_eos) on a bidirectional `Generate` stream, or with --one
// on the server-streaming `GenerateOne`, and prints each chunk as one JSON line. Exits 1 with
// the status on stderr if the RPC or the request fails.
'use strict';

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
  console.log(JSON.stringify({ request_id, index, token_ids, text, finish_reason, finished }));
  return finished;
}

function fail(error) {
  console.error(error.message || String(error));
  process.exit(1);
}

function main() {
  const [target, prompt, maxTokens, mode] = process.argv.slice(2);
  if (!target || !prompt || !maxTokens) fail(new Error('usage: client.js TARGET PROMPT MAX_TOKENS [--one]'));
  const v1 = loadGeneration();
  const client = new v1.Generation(target, grpc.credentials.createInsecure());
  const request = {
    request_id: 'node-1',
    text: prompt,
    config: { max_tokens: Number(maxTokens), temperature: 0, ignore_eos: true },
  };
  const call = mode === '--one' ? client.GenerateOne(request) : client.Generate();
  call.on('data', (response) => {
    try {
      for (const chunk of response.chunks) {
        // On the bidi stream, half-close once our request is done: the server then ends it.
        if (printChunk(chunk) && mode !== '--one') call.end();
      }
    } catch (error) {
      fail(error);
    }
  });
  call.on('error', fail);
  call.on('end', () => client.close());
  if (mode !== '--one') call.write({ request });
}

main();
