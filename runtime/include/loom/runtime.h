/*===- runtime.h - Loom runtime C API -------------------------------------===*
 *
 * Load a bundle written by `loomc compile`, bind inputs, run, read outputs,
 * save and load weights. Every call that can fail returns a loom_status_t*:
 * NULL on success, otherwise a status the caller frees with
 * loom_status_free() after reading loom_status_message().
 *
 *===----------------------------------------------------------------------===*/
#ifndef LOOM_RUNTIME_H
#define LOOM_RUNTIME_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/*--- Status ---------------------------------------------------------------*/

typedef enum loom_status_code_e {
  LOOM_OK = 0,
  LOOM_INVALID_ARGUMENT = 1, /* a caller's mistake: wrong name, size, option */
  LOOM_INVALID_BUNDLE = 2,   /* the bundle is corrupt, truncated or foreign */
  LOOM_UNSUPPORTED = 3,      /* valid, but this runtime or backend cannot run it */
  LOOM_IO_ERROR = 4,         /* a file could not be read or written */
  LOOM_INTERNAL = 5,         /* a bug in Loom: please report it */
  LOOM_RESOURCE_EXHAUSTED = 6, /* full for now (a server's queue): retry later */
} loom_status_code_t;

typedef struct loom_status_t loom_status_t;

loom_status_code_t loom_status_code(const loom_status_t *status);
/* The message; "ok" for NULL. Valid until the status is freed. */
const char *loom_status_message(const loom_status_t *status);
void loom_status_free(loom_status_t *status);

/*--- Tensors --------------------------------------------------------------*/

typedef enum loom_dtype_e {
  LOOM_F32 = 0,
  LOOM_F64 = 1,
  LOOM_BF16 = 2,
  LOOM_F16 = 3,
  LOOM_I32 = 4,
  LOOM_I64 = 5,
} loom_dtype_t;

#define LOOM_MAX_RANK 8

typedef struct loom_tensor_info_t {
  const char *name; /* valid while the session lives */
  loom_dtype_t dtype;
  int32_t rank;
  int64_t shape[LOOM_MAX_RANK];
  size_t bytes;
} loom_tensor_info_t;

/*--- Sessions -------------------------------------------------------------*/

typedef struct loom_session_t loom_session_t;

/* Fill with loom_session_options_init before setting fields: fields are only
 * ever added at the end, and the init gives each its default. */
typedef struct loom_session_options_t {
  /* "cpu" (default) or "cuda" when the runtime was built with CUDA. */
  const char *backend;
  /* Threads for the CPU backend, at most 1024; 0 = all hardware threads. */
  int32_t num_threads;
  /* Multi-rank bundles under mpirun: seconds a rank waits for its peers in
   * one collective or transfer before it fails and every rank stops; above 0
   * and at most 86400 (default 300). The process's first multi-rank session
   * sets it for the process. */
  double timeout_seconds;
} loom_session_options_t;

void loom_session_options_init(loom_session_options_t *options);

/* Opens the bundle directory at `bundle_path`, validates it and loads its
 * weights. `options` may be NULL for the defaults. A bundle of several ranks
 * opens in a job started with `mpirun -np N` (N = its rank count): each
 * process is the rank MPI numbers it, connected to the others (NCCL between
 * GPUs with the "cuda" backend, GPU = the local rank). */
loom_status_t *loom_session_create(const char *bundle_path,
                                   const loom_session_options_t *options,
                                   loom_session_t **out_session);
void loom_session_destroy(loom_session_t *session);

/* This session's rank in its bundle, and the bundle's rank count. */
int32_t loom_session_rank(const loom_session_t *session);
int32_t loom_session_num_ranks(const loom_session_t *session);

int32_t loom_session_num_inputs(const loom_session_t *session);
int32_t loom_session_num_outputs(const loom_session_t *session);
loom_status_t *loom_session_input_info(const loom_session_t *session, int32_t index,
                                       loom_tensor_info_t *out_info);
loom_status_t *loom_session_output_info(const loom_session_t *session, int32_t index,
                                        loom_tensor_info_t *out_info);

/* Copies `bytes` bytes of host data into the named input. The size must be
 * exactly the input's. Integer inputs (token ids) are range-checked when
 * they index an embedding. */
loom_status_t *loom_session_bind_input(loom_session_t *session, const char *name,
                                       const void *data, size_t bytes);

/* Runs the forward pass on the bound inputs. */
loom_status_t *loom_session_run_forward(loom_session_t *session);

/* Copies the named output (exactly its size) to host memory. */
loom_status_t *loom_session_read_output(loom_session_t *session, const char *name,
                                        void *data, size_t bytes);

/* Training bundles (loomc compile --train): forward, backward and optimizer
 * update on the bound batch; `out_loss` (may be NULL) receives the loss. */
loom_status_t *loom_session_train_step(loom_session_t *session, float *out_loss);
/* Optimizer steps taken so far (0 for inference bundles, -1 if the device
 * cannot be read). */
int64_t loom_session_step(const loom_session_t *session);
/* Parameters, optimizer state and step in one file, written to a temporary
 * file and renamed, with a checksum; loading refuses a damaged or foreign
 * checkpoint without changing the session. With a mixed-precision ZeRO-1
 * bundle (each rank keeps its slice of the f32 masters) saving checkpoints
 * or weights first gathers the masters, a collective: every rank saves. */
loom_status_t *loom_session_save_checkpoint(loom_session_t *session, const char *path);
loom_status_t *loom_session_load_checkpoint(loom_session_t *session, const char *path);

/* Weights as safetensors; saving writes a temporary file and renames it. */
loom_status_t *loom_session_save_weights(loom_session_t *session, const char *path);
loom_status_t *loom_session_load_weights(loom_session_t *session, const char *path);

/*--- Serving --------------------------------------------------------------*/

/* A server runs a serving bundle (`loomc compile --serve`): every rank of it
 * in this process (one thread each; NCCL between the GPUs of a
 * tensor-parallel bundle with the "cuda" backend), and a scheduler that
 * batches requests continuously over the bundle's paged key/value cache:
 * requests join and leave between decoding steps, long prompts are split so
 * that decoding sequences keep going. Thread-safe: submit and cancel from
 * any thread. Tokens arrive through the request's callback, on the server's
 * own thread, as they are produced. Example: runtime/examples/serve.c. */
typedef struct loom_server_t loom_server_t;

/* Structs below carry their own size: set by the *_init functions, so that
 * fields added later (at the end) keep old callers working. */
typedef struct loom_server_options_t {
  size_t struct_size;
  const char *backend;  /* "cpu" (default) or "cuda" */
  int32_t num_threads;  /* CPU backend, per rank; 0 = all hardware threads */
  int32_t max_queue;    /* requests waiting at most; more are refused with
                           LOOM_RESOURCE_EXHAUSTED (default 1024) */
} loom_server_options_t;
void loom_server_options_init(loom_server_options_t *options);

typedef struct loom_sampling_params_t {
  size_t struct_size;
  float temperature;          /* 0 (default): greedy */
  int32_t top_k;              /* 0 (default): off */
  float top_p;                /* 1 (default): off */
  float repetition_penalty;   /* 1 (default): off */
  uint64_t seed;              /* of this request's sampling (default 0) */
  int32_t max_new_tokens;     /* default 16; a sequence also ends at the bundle's max_seq */
  const int32_t *stop_tokens; /* generation ends after one of these; copied at submit */
  int32_t num_stop_tokens;
} loom_sampling_params_t;
void loom_sampling_params_init(loom_sampling_params_t *params);

typedef enum loom_finish_reason_e {
  LOOM_FINISH_NONE = 0,      /* more tokens follow */
  LOOM_FINISH_LENGTH = 1,    /* max_new_tokens or max_seq reached */
  LOOM_FINISH_STOP = 2,      /* a stop token was produced (it is this event's token) */
  LOOM_FINISH_CANCELLED = 3, /* loom_server_cancel, or the server shut down */
  LOOM_FINISH_ERROR = 4,     /* `error` says why */
} loom_finish_reason_t;

typedef struct loom_token_event_t {
  uint64_t request;
  int32_t token;               /* -1 on an event that only ends the request */
  int32_t index;               /* of the token among the request's new tokens */
  loom_finish_reason_t finish; /* not NONE on the request's last event */
  const char *error;           /* when finish is ERROR; valid during the callback */
} loom_token_event_t;

/* Called once per token and once more at the end unless the last token ends
 * the request (its event then carries the finish reason). It runs on the
 * server's thread: return quickly; it may call loom_server_submit and
 * loom_server_cancel. */
typedef void (*loom_token_callback_t)(const loom_token_event_t *event, void *user_data);

/* Opens the serving bundle at `bundle_path` (every rank) and starts the
 * scheduler. `options` may be NULL. */
loom_status_t *loom_server_create(const char *bundle_path, const loom_server_options_t *options,
                                  loom_server_t **out_server);
/* Cancels what is still queued or running (their callbacks get CANCELLED),
 * stops the scheduler and frees the server. */
void loom_server_destroy(loom_server_t *server);
/* Queues a request of `num_tokens` prompt token ids; `params` may be NULL
 * for greedy decoding of 16 tokens. On success `out_request` (may be NULL)
 * receives its id. Refused with LOOM_INVALID_ARGUMENT when it can never run
 * (empty or too long a prompt, a token outside the vocabulary, bad
 * parameters), with LOOM_RESOURCE_EXHAUSTED when the queue is full. */
loom_status_t *loom_server_submit(loom_server_t *server, const int32_t *tokens, size_t num_tokens,
                                  const loom_sampling_params_t *params, loom_token_callback_t callback,
                                  void *user_data, uint64_t *out_request);
/* Ends a request early; unknown or finished ids are ignored. */
loom_status_t *loom_server_cancel(loom_server_t *server, uint64_t request);
/* Refuses new requests, waits until every queued and running one finished,
 * and stops the scheduler (what a server does on SIGTERM). */
loom_status_t *loom_server_drain(loom_server_t *server);

typedef struct loom_server_stats_t {
  size_t struct_size;
  uint64_t submitted, finished, refused, cancelled;
  uint64_t prompt_tokens, generated_tokens, steps;
  uint64_t waiting, running;
  int64_t free_blocks, total_blocks;
} loom_server_stats_t;
void loom_server_stats_init(loom_server_stats_t *stats);
loom_status_t *loom_server_stats(const loom_server_t *server, loom_server_stats_t *out_stats);

/*--- Tokenizers -----------------------------------------------------------*/

/* The tokenizer a bundle carries (the manifest's "tokenizer", docs/import.md):
 * GPT-2's byte-level BPE (tokenizer.json) or SentencePiece (tokenizer.model,
 * where the runtime was built with it). Text is UTF-8. A tokenizer does not
 * change once opened: encode and decode from any number of threads at once. */
typedef struct loom_tokenizer_t loom_tokenizer_t;

/* Opens the tokenizer of the bundle directory `path` (a bundle that carries
 * none is refused with LOOM_INVALID_ARGUMENT), or the tokenizer.json or
 * SentencePiece .model file `path`. */
loom_status_t *loom_tokenizer_create(const char *path, loom_tokenizer_t **out_tokenizer);
void loom_tokenizer_destroy(loom_tokenizer_t *tokenizer);

/* The tokenizer of the server's bundle, owned by the server and valid until
 * loom_server_destroy; NULL in `out_tokenizer` (and no error) when the bundle
 * carries none. Read when first asked for. */
loom_status_t *loom_server_tokenizer(loom_server_t *server, const loom_tokenizer_t **out_tokenizer);

/* One more than the largest id. */
int32_t loom_tokenizer_vocab_size(const loom_tokenizer_t *tokenizer);
/* Begin- and end-of-sequence ids (SentencePiece's own; for BPE the added
 * token "<|endoftext|>", else "<s>" / "</s>"), or -1 when there is none. */
int32_t loom_tokenizer_bos_id(const loom_tokenizer_t *tokenizer);
int32_t loom_tokenizer_eos_id(const loom_tokenizer_t *tokenizer);
/* 1 when a prompt starts with BOS, as the checkpoint's own tokenizer does by
 * default (SentencePiece models: Llama's add_bos_token; not GPT-2's BPE); 0
 * otherwise. loom-run --prompt-text and loom-serve's text prompts do so. */
int loom_tokenizer_prepends_bos(const loom_tokenizer_t *tokenizer);

/* The ids of `text_bytes` bytes of `text`, with no special token such as BOS
 * added. Writes at most `capacity` ids to `tokens` (NULL when capacity is 0)
 * and the number of all of them to `out_num_tokens`: a number above
 * `capacity` asks for a call with a larger array. */
loom_status_t *loom_tokenizer_encode(const loom_tokenizer_t *tokenizer, const char *text,
                                     size_t text_bytes, int32_t *tokens, size_t capacity,
                                     size_t *out_num_tokens);
/* The text of `num_tokens` ids, the same way: at most `capacity` bytes to
 * `text` (no NUL is added), the length of all of it to `out_bytes`. Ids
 * outside the vocabulary decode to nothing. */
loom_status_t *loom_tokenizer_decode(const loom_tokenizer_t *tokenizer, const int32_t *tokens,
                                     size_t num_tokens, char *text, size_t capacity,
                                     size_t *out_bytes);

/* Decodes a generation one token at a time, as its tokens arrive. The bytes
 * of a UTF-8 character split over tokens wait for the token that completes
 * it, so every piece is whole characters; all pieces and the finish together
 * equal loom_tokenizer_decode of all the ids. One decoder per generation,
 * used by one thread at a time; its tokenizer must outlive it. */
typedef struct loom_token_decoder_t loom_token_decoder_t;
loom_status_t *loom_token_decoder_create(const loom_tokenizer_t *tokenizer,
                                         loom_token_decoder_t **out_decoder);
void loom_token_decoder_destroy(loom_token_decoder_t *decoder);
/* The text `token` completes: `out_text` receives it (NUL-terminated, valid
 * until the next call on the decoder), `out_bytes` (may be NULL) its length. */
loom_status_t *loom_token_decoder_push(loom_token_decoder_t *decoder, int32_t token,
                                       const char **out_text, size_t *out_bytes);
/* What is still held back (an unfinished character) as it is, at the end of
 * the generation; the decoder is then empty. */
loom_status_t *loom_token_decoder_finish(loom_token_decoder_t *decoder, const char **out_text,
                                         size_t *out_bytes);

/*--- Memory: reading outputs in place, binding inputs from a GPU ----------*/

/* Where memory is; the values are DLPack's device types (kDLCPU, kDLCUDA),
 * so a DLPack producer's or consumer's device converts as it is. */
typedef enum loom_device_type_e {
  LOOM_DEVICE_CPU = 1,
  LOOM_DEVICE_CUDA = 2,
} loom_device_type_t;

typedef struct loom_device_t {
  loom_device_type_t type;
  int32_t id; /* the CUDA device ordinal; 0 for the CPU */
} loom_device_t;

/* The device whose memory holds this session's arena: its inputs, outputs
 * and parameters (the CPU for the "cpu" backend, its GPU for "cuda"). */
loom_status_t *loom_session_device(const loom_session_t *session, loom_device_t *out_device);

/* The address of the named output inside the session's arena, in the memory
 * of loom_session_device: read it in place, without a copy (a DLPack view).
 * It stays valid until the session is destroyed, and each run
 * (loom_session_run_forward, loom_session_train_step) overwrites what it
 * holds. Every run has finished on the device when its call returns, so
 * reading it needs no synchronisation; it must not be written. */
loom_status_t *loom_session_output_data(loom_session_t *session, const char *name,
                                        void **out_data);

/* Like loom_session_bind_input, from memory on `device` (NULL: host memory).
 * Memory of the session's own GPU is copied device to device, with no host
 * round trip; another GPU's memory, or GPU memory for the "cpu" backend, is
 * refused. The copy is ordered after the work already queued on that GPU's
 * legacy default stream (stream 0), so a producer that wrote `data` on
 * another stream first makes stream 0 wait for it (what DLPack's
 * __dlpack__(stream=1) asks of the producer); the copy has finished when the
 * call returns, and `data` may then be reused. */
loom_status_t *loom_session_bind_input_from(loom_session_t *session, const char *name,
                                            const void *data, size_t bytes,
                                            const loom_device_t *device);

#ifdef __cplusplus
}
#endif

#endif /* LOOM_RUNTIME_H */
