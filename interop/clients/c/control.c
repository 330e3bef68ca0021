/* The consumer's control plane: compatibility hash and identity, nodes, sessions over ZeroMQ
 * DEALER + CURVE (ectp-v1.md sections 2, 7, 8.1, 8.3; ectp-v2.md section 2). One thread; every
 * wait has a deadline. */
#include "client.h"

#include <arpa/inet.h>
#include <math.h>
#include <netdb.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <zmq.h>

double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

void sleep_s(double s) {
    if (s <= 0) return;
    struct timespec t = {(time_t)s, (long)((s - floor(s)) * 1e9)};
    nanosleep(&t, NULL);
}

void log_msg(const char *fmt, const char *a, const char *b) {
    fprintf(stderr, "ectp-client: ");
    fprintf(stderr, fmt, a, b);
    fputc('\n', stderr);
}

/* -- compatibility hash (ectp-v1.md section 7), identity (section 8.3) --------------------- */
static void json_str(char **p, const char *s) {
    /* Python json.dumps(ensure_ascii=True): escapes, \uXXXX in lowercase hex, surrogate pairs */
    *(*p)++ = '"';
    const unsigned char *u = (const unsigned char *)s;
    while (*u) {
        unsigned cp = *u++;
        if (cp >= 0x80) {
            int n = cp >= 0xF0 ? 3 : cp >= 0xE0 ? 2 : 1;
            cp &= n == 3 ? 0x07 : n == 2 ? 0x0F : 0x1F;
            while (n-- && *u) cp = cp << 6 | (*u++ & 0x3F);
        }
        if (cp == '"' || cp == '\\') { *(*p)++ = '\\'; *(*p)++ = (char)cp; }
        else if (cp == '\n') { *(*p)++ = '\\'; *(*p)++ = 'n'; }
        else if (cp == '\r') { *(*p)++ = '\\'; *(*p)++ = 'r'; }
        else if (cp == '\t') { *(*p)++ = '\\'; *(*p)++ = 't'; }
        else if (cp == '\b') { *(*p)++ = '\\'; *(*p)++ = 'b'; }
        else if (cp == '\f') { *(*p)++ = '\\'; *(*p)++ = 'f'; }
        else if (cp < 0x20 || (cp >= 0x7F && cp < 0x10000)) *p += sprintf(*p, "\\u%04x", cp);
        else if (cp >= 0x10000) {
            cp -= 0x10000;
            *p += sprintf(*p, "\\u%04x\\u%04x", 0xD800 + (cp >> 10), 0xDC00 + (cp & 0x3FF));
        } else *(*p)++ = (char)cp;
    }
    *(*p)++ = '"';
}

int compat_hash(const char *model, const char *dtype, long long hidden, char out[65],
                long long *block_bytes) {
    static const struct { const char *n; int size; } SIZES[] = {
        {"bfloat16", 2}, {"float16", 2}, {"float32", 4}, {"float8_e4m3fn", 1},
        {"float8_e5m2", 1}, {"uint8", 1}, {"int8", 1}, {NULL, 0}};
    if (!strncmp(dtype, "torch.", 6)) dtype += 6;
    int i = 0;
    while (SIZES[i].n && strcmp(SIZES[i].n, dtype)) i++;
    if (!SIZES[i].n || hidden <= 0 || strlen(model) > 2000) return -1;
    *block_bytes = hidden * SIZES[i].size;
    char buf[16384], *p = buf;
    p += sprintf(p, "{\"block_bytes\":%lld,\"dtype\":", *block_bytes);
    json_str(&p, dtype);
    p += sprintf(p, ",\"ectp_major\":1,\"extra\":{},\"hidden\":%lld,\"layout\":", hidden);
    json_str(&p, "row-major/1row-per-block");
    p += sprintf(p, ",\"model\":");
    json_str(&p, model);
    *p++ = '}';
    unsigned char h[crypto_hash_sha256_BYTES];
    crypto_hash_sha256(h, (unsigned char *)buf, (unsigned long long)(p - buf));
    to_hex(h, sizeof h, out);
    return 0;
}

static void identity_of(const char *z85, char out[17]) {
    unsigned char h[crypto_hash_sha256_BYTES];
    char hex[65];
    crypto_hash_sha256(h, (const unsigned char *)z85, strlen(z85));
    to_hex(h, sizeof h, hex);
    memcpy(out, hex, 16);
    out[16] = 0;
}

/* -- node -------------------------------------------------------------------------------------- */
const char *jstr(json_t *o, const char *k, const char *dflt) {
    const char *s = json_string_value(json_object_get(o, k));
    return s ? s : dflt;
}

int ectp_version_mask = (1 << 1) | (1 << 2);

int is_trust_refusal(const char *detail) {
    if (strncmp(detail, "trust: ", 7)) return 0;
    size_t n = strspn(detail + 7, "abcdefghijklmnopqrstuvwxyz_");
    return n >= 1 && n <= 32 && !strncmp(detail + 7 + n, ": ", 2);
}

node_t *node_new(json_t *d, char *err, size_t errlen) {
    node_t *n = calloc(1, sizeof *n);
    json_t *planes = json_object_get(d, "planes"), *vs = json_object_get(d, "versions"), *v;
    size_t i;
    int tcp = 0;
    json_array_foreach(planes, i, v) tcp |= json_is_string(v) && !strcmp(json_string_value(v), "tcp");
    snprintf(n->model, sizeof n->model, "%s", jstr(d, "model", ""));
    snprintf(n->dtype, sizeof n->dtype, "%s", jstr(d, "dtype", ""));
    n->hidden = json_integer_value(json_object_get(d, "hidden"));
    n->region_bytes = json_integer_value(json_object_get(d, "region_bytes"));
    n->curve = !json_is_false(json_object_get(d, "curve"));
    if (!tcp) { snprintf(err, errlen, "refused:PlaneUnavailable|this client has the tcp plane only"); goto bad; }
    if (strcmp(jstr(d, "mem_kind", "DRAM"), "DRAM")) { snprintf(err, errlen, "refused:PlaneUnavailable|DRAM only"); goto bad; }
    if (compat_hash(n->model, n->dtype, n->hidden, n->compat, &n->block_bytes)) {
        snprintf(err, errlen, "refused:ConfigError|unknown dtype or bad hidden");
        goto bad;
    }
    if (json_is_array(vs) && json_array_size(vs)) {
        json_array_foreach(vs, i, v) {
            long long x = json_integer_value(v);
            if ((x == 1 || x == 2) && (ectp_version_mask >> x & 1) && n->nversions < 8)
                n->versions[n->nversions++] = (int)x;
        }
        if (!n->nversions) { snprintf(err, errlen, "refused:Unsupported|none of these ECTP versions is spoken here"); goto bad; }
    } else {
        for (int x = 1; x <= 2; x++)
            if (ectp_version_mask >> x & 1) n->versions[n->nversions++] = x;
    }
    if (n->curve) {
        const char *pub = jstr(d, "public_key", ""), *sec = jstr(d, "secret_key", "");
        if (strlen(pub) != 40 || strlen(sec) != 40) {
            snprintf(err, errlen, "refused:ConfigError|CURVE needs Z85 public_key and secret_key");
            goto bad;
        }
        memcpy(n->pub, pub, 41);
        memcpy(n->sec, sec, 41);
    }
    n->ctx = zmq_ctx_new();
    return n;
bad:
    free(n);
    return NULL;
}

void session_close(session_t *s) {
    if (s->mon) {
        zmq_socket_monitor(s->sock, NULL, 0);
        zmq_close(s->mon);
        s->mon = NULL;
    }
    if (s->sock) zmq_close(s->sock);
    s->sock = NULL;
}

void node_free(node_t *n) {
    for (int i = 0; i < n->nsessions; i++) session_close(&n->sessions[i]);
    zmq_ctx_term(n->ctx);
    free(n);
}

json_t *node_stats(node_t *n) {
    return json_pack("{s:i,s:I,s:I}", "producers", n->nsessions, "fetches", (json_int_t)n->fetches,
                     "landed_bytes", (json_int_t)n->landed_bytes);
}

/* -- control plane ------------------------------------------------------------------------------ */
int send_frame(session_t *s, const char *kind, json_t *fields) {
    unsigned char *buf;
    size_t len;
    char err[256];
    if (ectp_encode(kind, fields, &buf, &len, err, sizeof err)) {
        log_msg("cannot encode %s: %s", kind, err);
        return -1;
    }
    int rc = zmq_send(s->sock, buf, len, ZMQ_DONTWAIT);
    free(buf);
    return rc < 0 ? -1 : 0;
}

static void session_fail(session_t *s, const char *outcome, const char *miss, const char *detail);

/* the next event of a socket monitor (0 when none could be read): its number and value */
static uint16_t monitor_event(void *mon, uint32_t *val) {
    zmq_msg_t m;
    zmq_msg_init(&m);
    if (zmq_msg_recv(&m, mon, ZMQ_DONTWAIT) < 0) { zmq_msg_close(&m); return 0; }
    uint16_t ev = 0;
    *val = 0;
    if (zmq_msg_size(&m) >= 6) {
        memcpy(&ev, zmq_msg_data(&m), 2);
        memcpy(val, (char *)zmq_msg_data(&m) + 2, 4);
    }
    while (zmq_msg_more(&m)) { zmq_msg_close(&m); zmq_msg_init(&m); zmq_msg_recv(&m, mon, 0); }
    zmq_msg_close(&m);
    return ev;
}

/* A negotiated session whose control connection dropped has ended: the producer forgot it (a
 * restarted one never knew it), so the next fetch negotiates a new one (ectp-v1.md 2). Reads
 * the monitor's queued events; 1 when the session failed. */
static int peer_gone(session_t *s) {
    uint32_t val;
    uint16_t ev;
    while (s->mon && !s->failed && (ev = monitor_event(s->mon, &val)) != 0)
        if (ev == ZMQ_EVENT_DISCONNECTED)
            session_fail(s, "error:ECTransportError", "PEER_DOWN", "the producer went away (connection dropped)");
    return s->failed;
}

/* the next single-part frame until deadline, decoded with this session's acceptable versions;
 * a Nack ending the session for fleet trust (ectp-v1.md 8.2) fails it (AUTH) and returns -1 */
int recv_frame(node_t *n, session_t *s, double deadline, const char **kind, json_t **out) {
    for (;;) {
        if (peer_gone(s)) return -1;
        double left = deadline - now_s();
        if (left <= 0) return -1;
        zmq_pollitem_t it[2] = {{s->sock, 0, ZMQ_POLLIN, 0}, {s->mon, 0, ZMQ_POLLIN, 0}};
        if (zmq_poll(it, s->mon ? 2 : 1, (long)(left * 1000) + 1) <= 0) continue;
        if (!(it[0].revents & ZMQ_POLLIN)) continue; /* a monitor event: read at the top */
        zmq_msg_t m;
        zmq_msg_init(&m);
        if (zmq_msg_recv(&m, s->sock, ZMQ_DONTWAIT) < 0) { zmq_msg_close(&m); continue; }
        int more = zmq_msg_more(&m);
        int A[8], nA = s->version ? 1 : n->nversions;
        if (s->version) A[0] = s->version; else memcpy(A, n->versions, sizeof(int) * (size_t)nA);
        char err[512];
        int st = more ? ST_BAD_REQUEST
                      : ectp_decode(zmq_msg_data(&m), zmq_msg_size(&m), A, nA, kind, out, err,
                                    sizeof err);
        zmq_msg_close(&m);
        while (more) { /* a multi-part message is not ECTP: drop it whole */
            zmq_msg_init(&m);
            zmq_msg_recv(&m, s->sock, 0);
            more = zmq_msg_more(&m);
            zmq_msg_close(&m);
        }
        if (st == ST_OK && !strcmp(*kind, "nack") && is_trust_refusal(jstr(*out, "detail", ""))) {
            session_fail(s, "error:AuthError", "AUTH", jstr(*out, "detail", ""));
            json_decref(*out);
            *out = NULL;
            return -1;
        }
        if (st == ST_OK) return 0;
        log_msg("dropped a bad frame from the producer: %s%s", err, ""); /* consumers never answer */
    }
}

static void session_fail(session_t *s, const char *outcome, const char *miss, const char *detail) {
    s->failed = 1;
    snprintf(s->fail_outcome, sizeof s->fail_outcome, "%s", outcome);
    snprintf(s->fail_miss, sizeof s->fail_miss, "%s", miss);
    snprintf(s->fail_detail, sizeof s->fail_detail, "%s", detail);
}

/* wait for the ZMTP/CURVE handshake on the socket monitor (libzmq reports CURVE failures only
 * there); 0 = up, else the session has failed */
static int handshake(node_t *n, session_t *s, void *mon, double deadline) {
    int tcp = 0, hangups = 0;
    double end = fmin(deadline, now_s() + HANDSHAKE_S);
    while (now_s() < end) {
        zmq_pollitem_t it = {mon, 0, ZMQ_POLLIN, 0};
        if (zmq_poll(&it, 1, (long)((end - now_s()) * 1000) + 1) <= 0) continue;
        uint32_t val = 0;
        uint16_t ev = monitor_event(mon, &val);
        if (!ev) continue;
        char why[128];
        switch (ev) {
        case ZMQ_EVENT_CONNECTED: tcp = 1; break;
        case ZMQ_EVENT_HANDSHAKE_SUCCEEDED: return 0;
        case ZMQ_EVENT_HANDSHAKE_FAILED_AUTH:
            snprintf(why, sizeof why, "the producer refused this consumer's key (ZAP status %u)", val);
            session_fail(s, "error:AuthError", "AUTH", why);
            return -1;
        case ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL:
            session_fail(s, "error:AuthError", "AUTH",
                         "ZMTP handshake protocol error (plain/CURVE mismatch?)");
            return -1;
        case ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL:
        case ZMQ_EVENT_DISCONNECTED:
            if (++hangups >= 3) {
                session_fail(s, "error:AuthError", "AUTH",
                             "the producer hung up during the CURVE handshake (wrong server key?)");
                return -1;
            }
            break;
        }
    }
    (void)n;
    if (tcp) session_fail(s, "error:AuthError", "AUTH", "no CURVE/ZMTP handshake from the producer");
    else session_fail(s, "error:ECTransportError", "TIMEOUT", "producer unreachable");
    return -1;
}

/* the declared data-plane host must be the dialed host (ectp-v1.md 8.3); sets ep_addr */
static int same_host(session_t *s) {
    struct addrinfo hints = {0}, *a = NULL, *b = NULL;
    hints.ai_socktype = SOCK_STREAM;
    if (getaddrinfo(s->host, NULL, &hints, &a) || getaddrinfo(s->ep_host, NULL, &hints, &b)) {
        if (a) freeaddrinfo(a);
        return 0;
    }
    int ok = 0, dialed_lo = 0;
    for (struct addrinfo *x = a; x; x = x->ai_next)
        if (x->ai_family == AF_INET &&
            (ntohl(((struct sockaddr_in *)x->ai_addr)->sin_addr.s_addr) >> 24) == 127) dialed_lo = 1;
    for (struct addrinfo *y = b; y && !ok; y = y->ai_next) {
        char ya[INET6_ADDRSTRLEN] = "", xa[INET6_ADDRSTRLEN];
        getnameinfo(y->ai_addr, y->ai_addrlen, ya, sizeof ya, NULL, 0, NI_NUMERICHOST);
        int y_lo = y->ai_family == AF_INET &&
                   (ntohl(((struct sockaddr_in *)y->ai_addr)->sin_addr.s_addr) >> 24) == 127;
        for (struct addrinfo *x = a; x && !ok; x = x->ai_next) {
            getnameinfo(x->ai_addr, x->ai_addrlen, xa, sizeof xa, NULL, 0, NI_NUMERICHOST);
            ok = !strcmp(xa, ya) || (y_lo && dialed_lo);
        }
        if (ok) snprintf(s->ep_addr, sizeof s->ep_addr, "%s", ya);
    }
    freeaddrinfo(a);
    freeaddrinfo(b);
    return ok;
}

static void welcome(node_t *n, session_t *s, json_t *w, const char *server_key) {
    json_int_t st = json_integer_value(json_object_get(w, "status"));
    const char *detail = jstr(w, "detail", "");
    if (st == ST_VERSION) { session_fail(s, "error:VersionError", "VERSION", detail); return; }
    if (st == ST_INCOMPAT) {
        int same = !strcmp(jstr(w, "compat_hash", ""), n->compat); /* then: the planes */
        session_fail(s, same ? "error:NoCommonPlane" : "error:ProtocolError", "INCOMPATIBLE", detail);
        return;
    }
    if (st == ST_BAD_REQUEST && is_trust_refusal(detail)) { /* fleet trust refused us */
        session_fail(s, "error:AuthError", "AUTH", detail);
        return;
    }
    if (st != ST_OK) { session_fail(s, "error:ProtocolError", "INTERNAL", detail); return; }
    int v = (int)json_integer_value(json_object_get(w, "version")), ok = 0;
    for (int i = 0; i < n->nversions; i++) ok |= n->versions[i] == v;
    if (!ok || strcmp(jstr(w, "plane", ""), "tcp")) {
        session_fail(s, "error:ProtocolError", "INCOMPATIBLE", "Welcome chose a version or plane we did not offer");
        return;
    }
    size_t len = 0;
    unsigned char *ep = json_hex(json_object_get(w, "endpoint"), &len);
    json_t *e = NULL;
    char err[256] = "no endpoint declared (a consumer refuses unbound grants)";
    if (ep && len && tcp_decode("endpoint", ep, len, &e, err, sizeof err) == 0) {
        snprintf(s->ep_host, sizeof s->ep_host, "%s", jstr(e, "host", ""));
        snprintf(s->ep_node, sizeof s->ep_node, "%s", jstr(e, "node", ""));
        s->ep_port = (int)json_integer_value(json_object_get(e, "port"));
        char want[17] = "";
        if (server_key) identity_of(server_key, want);
        if (json_integer_value(json_object_get(e, "v")) != 1) snprintf(err, sizeof err, "endpoint version");
        else if (strcmp(jstr(e, "identity", ""), want)) snprintf(err, sizeof err, "endpoint identity is not the dialed key's");
        else if (!same_host(s)) snprintf(err, sizeof err, "endpoint host is not the dialed host");
        else err[0] = 0;
    }
    free(ep);
    json_decref(e);
    if (err[0]) { session_fail(s, "error:ProtocolError", "INCOMPATIBLE", err); return; }
    s->version = v;
    size_t fi;
    json_t *fv;
    json_array_foreach(json_object_get(w, "features"), fi, fv)
        s->dones |= json_is_string(fv) && !strcmp(json_string_value(fv), "dones");
}

session_t *session(node_t *n, json_t *p, double deadline) {
    const char *host = jstr(p, "host", "");
    int port = (int)json_integer_value(json_object_get(p, "port"));
    const char *key = n->curve ? json_string_value(json_object_get(p, "public_key")) : NULL;
    char skey[300];
    snprintf(skey, sizeof skey, "%s:%d", host, port);
    for (int i = 0; i < n->nsessions; i++) {
        session_t *s = &n->sessions[i];
        if (!strcmp(s->key, skey) && !peer_gone(s)) return s;
        if (!strcmp(s->key, skey)) { /* a failed session is retried with a fresh one */
            session_close(s);
            n->sessions[i] = n->sessions[--n->nsessions];
            break;
        }
    }
    if (n->nsessions == MAX_SESSIONS) return NULL;
    session_t *s = &n->sessions[n->nsessions++];
    memset(s, 0, sizeof *s);
    snprintf(s->key, sizeof s->key, "%s", skey);
    snprintf(s->host, sizeof s->host, "%s", host);
    s->port = port;
    unsigned char r[16];
    randombytes_buf(r, sizeof r);
    to_hex(r, sizeof r, s->sid);
    if (n->curve && (!key || strlen(key) != 40)) {
        session_fail(s, "error:ConfigError", "INTERNAL", "CURVE needs the producer's public key");
        return s;
    }
    s->sock = zmq_socket(n->ctx, ZMQ_DEALER);
    int zero = 0, ivl = 100;
    int64_t maxmsg = MAX_FRAME_BYTES;
    zmq_setsockopt(s->sock, ZMQ_LINGER, &zero, sizeof zero);
    zmq_setsockopt(s->sock, ZMQ_RECONNECT_IVL, &ivl, sizeof ivl);
    zmq_setsockopt(s->sock, ZMQ_MAXMSGSIZE, &maxmsg, sizeof maxmsg);
    if (n->curve) {
        zmq_setsockopt(s->sock, ZMQ_CURVE_SERVERKEY, key, 40);
        zmq_setsockopt(s->sock, ZMQ_CURVE_PUBLICKEY, n->pub, 40);
        zmq_setsockopt(s->sock, ZMQ_CURVE_SECRETKEY, n->sec, 40);
    }
    char mon_ep[64], ep[300];
    snprintf(mon_ep, sizeof mon_ep, "inproc://ectp-mon-%d", n->monitors++);
    zmq_socket_monitor(s->sock, mon_ep, ZMQ_EVENT_ALL);
    void *mon = zmq_socket(n->ctx, ZMQ_PAIR);
    zmq_connect(mon, mon_ep);
    snprintf(ep, sizeof ep, strchr(host, ':') ? "tcp://[%s]:%d" : "tcp://%s:%d", host, port);
    zmq_connect(s->sock, ep);
    if (handshake(n, s, mon, deadline) != 0) {
        zmq_socket_monitor(s->sock, NULL, 0);
        zmq_close(mon);
        return s;
    }
    s->mon = mon; /* kept: a DISCONNECTED from here on ends the session (peer_gone) */
    json_t *vs = json_array();
    for (int i = 0; i < n->nversions; i++) json_array_append_new(vs, json_integer(n->versions[i]));
    int top = n->versions[n->nversions - 1];
    for (int i = 0; i < n->nversions; i++) top = n->versions[i] > top ? n->versions[i] : top;
    json_t *hello = json_pack("{s:i,s:s,s:s,s:o,s:[s],s:s,s:[s]}", "v", top, "session_id", s->sid,
                              "node_id", "ectp-c", "versions", vs, "planes", "tcp", "compat_hash",
                              n->compat, "mem_kinds", "DRAM");
    send_frame(s, "hello", hello);
    json_decref(hello);
    double end = fmin(deadline, now_s() + HELLO_TIMEOUT_S);
    const char *kind;
    json_t *w;
    while (recv_frame(n, s, end, &kind, &w) == 0) {
        int mine = !strcmp(kind, "welcome") && !strcmp(jstr(w, "session_id", ""), s->sid);
        if (mine) welcome(n, s, w, key);
        json_decref(w);
        if (mine) return s;
    }
    session_fail(s, "error:ECTransportError", "TIMEOUT", "no Welcome in time");
    return s;
}

json_t *node_connect(node_t *n, json_t *p, double timeout_s) {
    double t0 = now_s();
    session_t *s = session(n, p, t0 + timeout_s);
    if (!s) return json_pack("{s:s,s:s}", "outcome", "error:ECTransportError", "detail", "too many producers");
    if (s->failed)
        return json_pack("{s:s,s:s,s:f}", "outcome", s->fail_outcome, "detail", s->fail_detail,
                         "seconds", now_s() - t0);
    return json_pack("{s:s,s:s,s:i,s:f}", "outcome", "ok", "plane", "tcp", "version", s->version,
                     "seconds", now_s() - t0);
}

