// The main node's OpenAI-compatible HTTP API (cpp-httplib from Debian, a thread per connection) at the main
// node's `http_address`:
//   POST /v1/completions, POST /v1/chat/completions  (stream: true -> server-sent events ending data: [DONE])
//   POST /tokenize, POST /detokenize                  (vLLM's: main's tokenizer and chat template, no model run)
//   GET  /v1/models, GET /v1/models/{id}              (the one model: its folder's name)
//   GET  /health                                      (503 until main is ready, 200 after, as llama.cpp's)
//   GET  /metrics                                     (only when http_address is also the metrics_address)
// Requests and responses are built by src/main_node/openai_api.h. Each choice of a request (its prompts times `n`)
// is one MainNode::RunRequest, and they run side by side (src/main_node/choices.h: up to max_running at once, on
// threads of the request's own), so main's batch loop decodes them together. The first of them take their places
// in main's queue together before any work (a full queue is a 429 for the whole request); a choice that fails
// fails the request and stops the others. Text prompts and chat are tokenized here with the model's tokenizer, so
// a request is checked against the model (vocabulary, context length, sampling options) before any byte of a
// stream is sent: a bad request is always a 400 with OpenAI's error object, never a broken stream.
//
// Cancellation: the pool thread of a request checks its client every 20 ms while the choices run (a stream's
// writer through its DataSink, a whole answer's through src/main_node/client_connection.h) and the choices poll its
// verdict (between steps, through RunRequest's `stop`), so a client that closes the connection cancels the request
// within one decode step; odmoe_http_client_disconnects_total counts these (a whole answer's also counts as a 499
// in odmoe_http_requests_total; a stream's was counted as its 200). Stopping the server ends every request in
// flight the same way, as Unavailable (503, or an error event in a stream); a choice that fails ends its siblings
// as Aborted, and main's log tells the three apart. A request waiting for its turn holds one pool
// thread; it waits at most for the requests ahead of it, each bounded by its max_tokens and the cluster's RPC
// deadlines, and a write to a client that stops reading fails after the write timeout (which cancels the
// request); meanwhile its choices wait on a bounded queue of events.
//
// Browsers: pages of the origins in `allowed_origins` may call the API (CORS: the response headers that let them
// read an answer, and 204 to their preflights, which need no API key); other origins' preflights are answered 403.
//
// Authorization hook: `authorize` (optional) sees every request before its handler; false answers 401 with
// OpenAI's error object. OptionsFor sets it to the cluster's client token ([auth] token_file: the header
// `Authorization: Bearer TOKEN`, as the gRPC API takes it). With [tls] the API is served over HTTPS with main's
// certificate and key (the same files as its gRPC port), so the token never crosses the network in clear.
//
// Thread safety: handlers run on the server's threads; SetReady may be called from any thread. The MainNode and
// the metrics registry must outlive the server, whose destructor ends the requests in flight (Shutdown at once)
// and joins its threads.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "src/common/cluster_config.h"
#include "src/common/metrics.h"
#include "src/main_node/main_node.h"
#include "src/main_node/openai_api.h"

namespace httplib {
class Server;
struct Request;
}  // namespace httplib

namespace odmoe {

struct HttpServerOptions {
  std::string node;      // for messages
  std::string address;   // host:port; port 0 picks a free one
  std::string model_id;  // the model's name in the API (rpc::DaemonMetricLabels' model)
  // Other names a request may give for it ([model] served_model_name after the first); /v1/models lists them too.
  std::vector<std::string> model_aliases;
  // Connections served at once, each on a thread of its own (one kept spare: rpc::StartHttpServer),
  // requests running or waiting for their turn and idle keep-alive connections alike; more wait in the kernel's
  // listen backlog.
  int max_connections = 8;
  // Also serve GET /metrics from this registry (http_address == metrics_address); nullptr: no /metrics.
  const metrics::Registry* metrics_to_serve = nullptr;
  // The authorization hook (see the file comment); empty: every request is let through.
  std::function<bool(const httplib::Request&)> authorize;
  // The origins whose browser pages may call the API (CORS: NodeConfig::http_allowed_origins), or just "*" for
  // any; empty: none (a browser's preflight is answered 403).
  std::vector<std::string> allowed_origins;
  // How chat answers' reasoning is told from their content ([model] reasoning_parser; src/main_node/reasoning.h).
  ReasoningParser reasoning_parser = ReasoningParser::kNone;
  // PEM certificate and key: serve HTTPS; both empty: plain HTTP.
  std::string tls_cert, tls_key;
};

class HttpServer {
 public:
  // Binds `options.address` and serves `node`'s model. Its metrics (odmoe_http_requests_total{endpoint,code},
  // odmoe_http_client_disconnects_total) go to `registry`. Unavailable naming the node and the address when the
  // address cannot be bound; FailedPrecondition when the model's tokenizer_config.json is not valid JSON.
  static absl::StatusOr<std::unique_ptr<HttpServer>> Start(MainNode* node, HttpServerOptions options,
                                                           metrics::Registry* registry);
  // The HttpServerOptions of main's node (`http_address`, the model id of its metrics' labels, a shared
  // /metrics when http_address == metrics_address, the process's client token (rpc::ProcessSecurity), and
  // main's certificate with [tls]).
  static HttpServerOptions OptionsFor(const rpc::DaemonArgs& args, const metrics::Registry* registry);
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // Graceful stop, in two steps so that main can drain its gRPC calls meanwhile. StopAccepting: the port closes
  // at once (new connections are refused; a request already on its way is answered 503), unless it also serves
  // /metrics: then it stays open until Shutdown, /health answers 503 and completions 503, so that the drain can be
  // watched. Shutdown: requests in flight get until `deadline` to finish, a stream until its last byte; those
  // still running then end as Unavailable (503, or an error event in a stream). Returns when the server's threads
  // have ended. Both are idempotent; the destructor calls Shutdown(now). REQUIRES: called from one thread at a
  // time.
  void StopAccepting();
  void Shutdown(absl::Time deadline);

  // Main's readiness, for GET /health (`reason` explains a 503).
  void SetReady(bool ready, const std::string& reason);
  int port() const { return port_; }
  // http://HOST:PORT with the port actually bound.
  const std::string& url() const { return url_; }

  struct Impl;  // the handlers (http_server.cc)

 private:
  HttpServer() = default;
  void CloseListener();  // the port, once
  std::unique_ptr<Impl> impl_;
  std::unique_ptr<httplib::Server> http_;
  std::thread thread_;
  bool listening_ = true;  // until CloseListener
  int port_ = 0;
  std::string url_;
};

}  // namespace odmoe
