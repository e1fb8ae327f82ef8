/*===- serve.c - Serving with the Loom runtime from C --------------------===*
 *
 * usage: loom-serve-example SERVING_BUNDLE PROMPTS [THREADS]
 *
 * Opens a serving bundle (loomc compile --serve), then THREADS threads (2 by
 * default) each submit every other prompt of PROMPTS (token ids, one prompt
 * per line) at once; tokens stream back through the callback as the server
 * produces them. One extra request is cancelled right after it is
 * submitted. The server is drained, and each request's tokens and finish
 * reason printed, in the order of the prompt file. Every status is checked.
 *
 *===---------------------------------------------------------------------===*/

#include "loom/runtime.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_PROMPTS 64
#define MAX_TOKENS 1024

typedef struct {
  int32_t prompt[MAX_TOKENS];
  size_t length;
  int32_t tokens[MAX_TOKENS];
  int count;
  loom_finish_reason_t finish;
  char error[256];
} request_t;

static request_t requests[MAX_PROMPTS + 1];
static size_t num_prompts;
static loom_server_t *server;
static int threads = 2;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

static int check(loom_status_t *status, const char *what) {
  if (!status)
    return 0;
  fprintf(stderr, "%s failed: %s\n", what, loom_status_message(status));
  loom_status_free(status);
  return 1;
}

/* Runs on the server's thread, once per token and at the end. */
static void on_token(const loom_token_event_t *event, void *user_data) {
  request_t *r = (request_t *)user_data;
  pthread_mutex_lock(&lock);
  if (event->token >= 0 && r->count < MAX_TOKENS)
    r->tokens[r->count++] = event->token;
  if (event->finish != LOOM_FINISH_NONE) {
    r->finish = event->finish;
    if (event->error)
      snprintf(r->error, sizeof r->error, "%s", event->error);
  }
  pthread_mutex_unlock(&lock);
}

static void *submitter(void *arg) {
  long first = (long)arg;
  loom_sampling_params_t params;
  loom_sampling_params_init(&params);
  params.max_new_tokens = 8;
  for (size_t i = (size_t)first; i < num_prompts; i += (size_t)threads) {
    request_t *r = &requests[i];
    if (check(loom_server_submit(server, r->prompt, r->length, &params, on_token, r, NULL), "submit"))
      exit(1);
  }
  return NULL;
}

static const char *reason(loom_finish_reason_t f) {
  switch (f) {
  case LOOM_FINISH_LENGTH: return "length";
  case LOOM_FINISH_STOP: return "stop";
  case LOOM_FINISH_CANCELLED: return "cancelled";
  case LOOM_FINISH_ERROR: return "error";
  default: return "unfinished";
  }
}

int main(int argc, char **argv) {
  if (argc < 3 || argc > 4) {
    fprintf(stderr, "usage: %s SERVING_BUNDLE PROMPTS [THREADS]\n", argv[0]);
    return 1;
  }
  if (argc == 4)
    threads = atoi(argv[3]) > 0 ? atoi(argv[3]) : 1;
  FILE *in = fopen(argv[2], "r");
  if (!in) {
    fprintf(stderr, "cannot open %s\n", argv[2]);
    return 1;
  }
  char line[8192];
  while (num_prompts < MAX_PROMPTS && fgets(line, sizeof line, in)) {
    request_t *r = &requests[num_prompts];
    for (char *word = strtok(line, " \t\r\n"); word && r->length < MAX_TOKENS; word = strtok(NULL, " \t\r\n"))
      r->prompt[r->length++] = (int32_t)atoi(word);
    if (r->length > 0)
      ++num_prompts;
  }
  fclose(in);

  loom_server_options_t options;
  loom_server_options_init(&options);
  if (check(loom_server_create(argv[1], &options, &server), "loom_server_create"))
    return 1;
  pthread_t workers[16];
  if (threads > 16)
    threads = 16;
  for (long t = 0; t < threads; ++t)
    pthread_create(&workers[t], NULL, submitter, (void *)t);
  /* One more request, cancelled at once: it ends with CANCELLED (or, if
   * the server was quick, with the tokens it had). */
  request_t *extra = &requests[num_prompts];
  extra->prompt[0] = 1;
  extra->length = 1;
  uint64_t id = 0;
  loom_sampling_params_t params;
  loom_sampling_params_init(&params);
  params.max_new_tokens = 1000;
  if (check(loom_server_submit(server, extra->prompt, 1, &params, on_token, extra, &id), "submit") ||
      check(loom_server_cancel(server, id), "cancel"))
    return 1;
  for (int t = 0; t < threads; ++t)
    pthread_join(workers[t], NULL);
  if (check(loom_server_drain(server), "drain"))
    return 1;
  loom_server_stats_t stats;
  loom_server_stats_init(&stats);
  if (check(loom_server_stats(server, &stats), "stats"))
    return 1;
  for (size_t i = 0; i < num_prompts; ++i) {
    printf("request %zu: %zu prompt + %d new tokens (%s):", i, requests[i].length, requests[i].count,
           reason(requests[i].finish));
    for (int k = 0; k < requests[i].count; ++k)
      printf(" %d", requests[i].tokens[k]);
    printf("%s%s\n", requests[i].error[0] ? " error: " : "", requests[i].error);
  }
  printf("cancelled request: %s\n", reason(extra->finish));
  printf("stats: %llu submitted, %llu finished, %llu cancelled, %llu tokens, %lld of %lld blocks free\n",
         (unsigned long long)stats.submitted, (unsigned long long)stats.finished,
         (unsigned long long)stats.cancelled, (unsigned long long)stats.generated_tokens,
         (long long)stats.free_blocks, (long long)stats.total_blocks);
  /* Refused after the drain, with a status. */
  loom_status_t *late = loom_server_submit(server, extra->prompt, 1, NULL, on_token, extra, NULL);
  printf("after drain: %s\n", late ? loom_status_message(late) : "accepted");
  loom_status_free(late);
  loom_server_destroy(server);
  return 0;
}
