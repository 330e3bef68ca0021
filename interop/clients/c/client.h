/* Internal to the consumer (control.c, fetch.c): its node and session state. */
#ifndef ECTP_CLIENT_H
#define ECTP_CLIENT_H

#include "ectp.h"

#include <netinet/in.h>

#define ACK_TIMEOUT_S 2.0   /* XferReq/ReqBatch -> answer (ectp-v1.md 8.2) */
#define HELLO_TIMEOUT_S 5.0 /* Hello -> Welcome */
#define HANDSHAKE_S 5.0     /* TCP connect + CURVE handshake */
#define WAIT_S 5.0          /* ReqBatch.wait_s asked for */
#define INLINE_MAX 65536    /* ReqBatch.inline_max */
#define MAX_SESSIONS 16

typedef struct {
    char key[300], host[256], sid[33], fail_outcome[64], fail_miss[32], fail_detail[512];
    int port, version, failed, closed;
    int dones; /* the Welcome's features list "dones": completions may go as one DoneBatch */
    void *mon; /* the socket monitor's PAIR: a DISCONNECTED there ends the session (peer down) */
    void *sock;
    char ep_host[256], ep_node[257], ep_addr[INET6_ADDRSTRLEN];
    int ep_port;
} session_t;

struct node {
    char model[512], dtype[64], pub[41], sec[41], compat[65];
    int curve, versions[8], nversions;
    long long hidden, block_bytes, region_bytes, fetches, landed_bytes;
    void *ctx;
    session_t sessions[MAX_SESSIONS];
    int nsessions, monitors;
};

void sleep_s(double s);
void log_msg(const char *fmt, const char *a, const char *b);
const char *jstr(json_t *o, const char *k, const char *dflt);
int send_frame(session_t *s, const char *kind, json_t *fields);
int recv_frame(node_t *n, session_t *s, double deadline, const char **kind, json_t **out);
session_t *session(node_t *n, json_t *p, double deadline);
void session_close(session_t *s);

#endif
