// bench_peers_driver: greedy decode with llama.cpp through its public C API (llama.h), timed
// by phase, for tools/bench_peers.py. Built by that script against its cached llama.cpp build.
//
//   bench_peers_driver MODEL.gguf LOAD_MODE REPACK THREADS N_PREDICT ID [ID ...]
//     LOAD_MODE: mmap | none (read into anonymous memory); REPACK: 1 = llama.cpp's default
//     CPU weight repacking (use_extra_bufts), 0 = off. IDs: the prompt's token ids, given by the
//     caller so both engines see the same input whatever their tokenizers do.
//
// Prints one JSON object on stdout: the generated ids, seconds and /proc/self/io read_bytes at
// the end of load, prefill and decode, and peak RSS (getrusage). Exit 2 on bad arguments,
// 1 when llama.cpp fails.
#include "llama.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double) ts.tv_sec + 1e-9 * (double) ts.tv_nsec;
}

// Bytes this process made the kernel fetch from storage (page faults on mmap included).
static long long read_bytes(void) {
    FILE * f = fopen("/proc/self/io", "r");
    if (!f) {
        return -1;
    }
    char key[64];
    long long v = -1, out = -1;
    while (fscanf(f, "%63s %lld", key, &v) == 2) {
        if (strcmp(key, "read_bytes:") == 0) {
            out = v;
        }
    }
    fclose(f);
    return out;
}

static void quiet_log(enum ggml_log_level level, const char * text, void * user) {
    (void) user;
    if (level >= GGML_LOG_LEVEL_WARN) {
        fputs(text, stderr);
    }
}

static int argmax(const float * logits, int n) {
    int best = 0;
    for (int i = 1; i < n; i++) {
        if (logits[i] > logits[best]) {
            best = i;
        }
    }
    return best;
}

int main(int argc, char ** argv) {
    if (argc < 7) {
        fprintf(stderr, "usage: %s MODEL LOAD_MODE(mmap|none) REPACK(0|1) THREADS N_PREDICT ID...\n",
                argv[0]);
        return 2;
    }
    const char * path = argv[1];
    const int mmap_mode = strcmp(argv[2], "mmap") == 0;
    if (!mmap_mode && strcmp(argv[2], "none") != 0) {
        fprintf(stderr, "LOAD_MODE must be mmap or none, not %s\n", argv[2]);
        return 2;
    }
    const int repack = atoi(argv[3]);
    const int threads = atoi(argv[4]);
    const int n_predict = atoi(argv[5]);
    const int n_prompt = argc - 6;
    if (threads < 1 || n_predict < 1) {
        fprintf(stderr, "THREADS and N_PREDICT must be >= 1\n");
        return 2;
    }
    llama_token * prompt = malloc(sizeof(llama_token) * (size_t) n_prompt);
    int * out = malloc(sizeof(int) * (size_t) n_predict);
    if (!prompt || !out) {
        return 1;
    }
    for (int i = 0; i < n_prompt; i++) {
        prompt[i] = atoi(argv[6 + i]);
    }

    llama_log_set(quiet_log, NULL);
    llama_backend_init();
    const double t0 = now_s();
    struct llama_model_params mp = llama_model_default_params();
    mp.load_mode = mmap_mode ? LLAMA_LOAD_MODE_MMAP : LLAMA_LOAD_MODE_NONE;
    mp.use_extra_bufts = repack != 0;
    struct llama_model * model = llama_model_load_from_file(path, mp);
    if (!model) {
        fprintf(stderr, "llama.cpp could not load %s\n", path);
        return 1;
    }
    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = (uint32_t) (n_prompt + n_predict + 16);
    cp.n_batch = (uint32_t) (n_prompt > 32 ? n_prompt : 32);
    cp.n_threads = threads;
    cp.n_threads_batch = threads;
    struct llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) {
        fprintf(stderr, "llama.cpp could not create a context\n");
        return 1;
    }
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    const double t_load = now_s();
    const long long r_load = read_bytes();

    if (llama_decode(ctx, llama_batch_get_one(prompt, n_prompt)) != 0) {
        fprintf(stderr, "llama_decode failed on the prompt\n");
        return 1;
    }
    llama_token tok = argmax(llama_get_logits_ith(ctx, -1), n_vocab);
    out[0] = tok;
    const double t_prefill = now_s();
    const long long r_prefill = read_bytes();

    for (int i = 1; i < n_predict; i++) {
        if (llama_decode(ctx, llama_batch_get_one(&tok, 1)) != 0) {
            fprintf(stderr, "llama_decode failed at token %d\n", i);
            return 1;
        }
        tok = argmax(llama_get_logits_ith(ctx, -1), n_vocab);
        out[i] = tok;
    }
    const double t_decode = now_s();
    const long long r_decode = read_bytes();

    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    printf("{\"ids\": [");
    for (int i = 0; i < n_predict; i++) {
        printf(i ? ", %d" : "%d", out[i]);
    }
    printf("], \"load_s\": %.6f, \"prefill_s\": %.6f, \"decode_s\": %.6f, "
           "\"decode_forwards\": %d, \"read_load\": %lld, \"read_prefill\": %lld, "
           "\"read_decode\": %lld, \"maxrss_kib\": %ld, \"system\": \"%s\"}\n",
           t_load - t0, t_prefill - t_load, t_decode - t_prefill, n_predict - 1,
           r_load, r_prefill - r_load, r_decode - r_prefill, ru.ru_maxrss,
           llama_print_system_info());
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    free(prompt);
    free(out);
    return 0;
}
