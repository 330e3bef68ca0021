/* ectp-client: an independent ECTP v1/v2 consumer over the tcp data plane, written from
 * protocols/ectp-v1.md, protocols/ectp-v2.md and protocols/plane-tcp.md (not from the Python
 * code). Frames are handled as JSON values (jansson) validated against a schema per kind;
 * bin fields are "hex:<lowercase hex>" strings, as in the golden vectors' index.json. */
#ifndef ECTP_H
#define ECTP_H

#include <jansson.h>
#include <stddef.h>
#include <stdint.h>

/* status codes (ectp-v1.md section 5) */
enum { ST_OK = 0, ST_MISSING = 1, ST_INCOMPAT = 2, ST_VERSION = 3, ST_INTERNAL = 4,
       ST_NOT_READY = 5, ST_BUSY = 6, ST_BAD_REQUEST = 7 };

#define MAX_FRAME_BYTES (8u << 20)

/* Decode one ECTP frame with the acceptable versions A[0..nA) (section 6: size, envelope,
 * kind, version, SINCE, body). On success returns ST_OK, sets *kind (static string) and *out
 * (the fields without "k", every optional field present with its default). Otherwise returns
 * ST_BAD_REQUEST or ST_VERSION with a reason in err; *kind is the kind if it was identified
 * (NULL otherwise). */
int ectp_decode(const unsigned char *buf, size_t len, const int *A, int nA, const char **kind,
                json_t **out, char *err, size_t errlen);

/* Encode fields (same shape as ectp_decode's output) as a frame of kind; 0 on success, -1 with
 * err when a field is missing or out of bounds. *buf is malloc'ed. */
int ectp_encode(const char *kind, json_t *fields, unsigned char **buf, size_t *len, char *err,
                size_t errlen);

/* The tcp plane's msgpack structures (plane-tcp.md): "endpoint", "grant", "request", "reply".
 * Same conventions as the ECTP codec; returns 0 / -1. */
int tcp_decode(const char *what, const unsigned char *buf, size_t len, json_t **out, char *err,
               size_t errlen);
int tcp_encode(const char *what, json_t *fields, unsigned char **buf, size_t *len, char *err,
               size_t errlen);

/* hex helpers: "hex:..." <-> bytes */
json_t *hex_json(const unsigned char *b, size_t n);
/* bytes of a "hex:..." string (malloc'ed, *n set); NULL if not such a string */
unsigned char *json_hex(json_t *v, size_t *n);
void to_hex(const unsigned char *b, size_t n, char *out); /* out: 2n+1 chars */

/* client.c */
typedef struct node node_t;
/* The ECTP versions this process may speak, bit v set for version v (default 1 and 2;
 * `adapter --versions 1` narrows it): hello reports them, a node speaks their intersection
 * with its description's `versions`. */
extern int ectp_version_mask;
/* 1 when a NACK_BAD_REQUEST detail is a fleet-trust refusal, "trust: <reason>: <text>" with
 * <reason> of [a-z_]{1,32} (certificates.md section 6, ectp-v1.md 8.1): an authentication
 * failure, reported as error:AuthError / miss:AUTH. */
int is_trust_refusal(const char *detail);
node_t *node_new(json_t *desc, char *err, size_t errlen);
void node_free(node_t *n);
json_t *node_connect(node_t *n, json_t *producer, double timeout_s);
json_t *node_fetch(node_t *n, json_t *producer, json_t *mm_hashes, double timeout_s, int many);
json_t *node_stats(node_t *n);
int compat_hash(const char *model, const char *dtype, long long hidden, char out[65],
                long long *block_bytes);

/* vectors check (vectors.c in adapter.c): every version dir under root */
json_t *check_vectors(const char *root, json_t *versions, int verbose);

double now_s(void);

#endif
