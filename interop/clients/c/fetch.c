/* Fetching: v1 requests, v2 batches with Parked, inline answers and DoneBatch
 * (ectp-v1.md 8.2, 8.4; ectp-v2.md 4-6), and transfers over the tcp plane (plane-tcp.md). */
#include "client.h"

#include <errno.h>
#include <math.h>
#include <netdb.h>
#include <netinet/tcp.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>
#include <zmq.h>

/* -- tcp plane (plane-tcp.md) ------------------------------------------------------------------ */
static int read_all(int fd, unsigned char *b, size_t n) {
    size_t got = 0;
    while (got < n) {
        ssize_t k = recv(fd, b + got, n - got, 0);
        if (k <= 0) return -1;
        got += (size_t)k;
    }
    return 0;
}

/* receive the granted bytes of tcp grant g into buf[0..nbytes); 0 or -1 with err */
static int tcp_receive(session_t *s, json_t *g, long long nbytes, long long runs_bytes,
                       unsigned char *buf, double deadline, char *err, size_t errlen) {
    size_t glen;
    unsigned char *gb = json_hex(json_object_get(g, "plane_grant"), &glen);
    json_t *tg = NULL;
    int rc = -1, fd = -1;
    if (!gb || tcp_decode("grant", gb, glen, &tg, err, errlen)) goto out;
    if (strcmp(jstr(tg, "host", ""), s->ep_host) || strcmp(jstr(tg, "node", ""), s->ep_node) ||
        json_integer_value(json_object_get(tg, "port")) != s->ep_port) {
        snprintf(err, errlen, "grant names another host, port or node than the endpoint");
        goto out;
    }
    if (json_integer_value(json_object_get(tg, "nbytes")) != nbytes ||
        json_integer_value(json_object_get(tg, "runs_bytes")) != runs_bytes) {
        snprintf(err, errlen, "tcp grant sizes differ from the ECTP grant's");
        goto out;
    }
    struct addrinfo hints = {0}, *ai;
    char port[16];
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_NUMERICHOST;
    snprintf(port, sizeof port, "%d", s->ep_port);
    if (getaddrinfo(s->ep_addr, port, &hints, &ai)) { snprintf(err, errlen, "bad address"); goto out; }
    fd = socket(ai->ai_family, SOCK_STREAM, 0);
    double left = fmax(0.05, fmin(10.0, deadline - now_s()));
    struct timeval tv = {(time_t)left, (long)((left - floor(left)) * 1e6)};
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    int c = connect(fd, ai->ai_addr, ai->ai_addrlen);
    freeaddrinfo(ai);
    if (c) { snprintf(err, errlen, "tcp connect: %s", strerror(errno)); goto out; }
    json_t *req = json_pack("{s:i,s:O,s:s}", "v", 1, "token", json_object_get(tg, "token"),
                            "notif", "hex:");
    unsigned char *body, head[4];
    size_t blen;
    int bad = tcp_encode("request", req, &body, &blen, err, errlen);
    json_decref(req);
    if (bad) goto out;
    unsigned char *frame = malloc(blen + 4);
    frame[0] = (unsigned char)(blen >> 24), frame[1] = (unsigned char)(blen >> 16);
    frame[2] = (unsigned char)(blen >> 8), frame[3] = (unsigned char)blen;
    memcpy(frame + 4, body, blen);
    ssize_t sent = send(fd, frame, blen + 4, MSG_NOSIGNAL);
    free(frame);
    free(body);
    if (sent != (ssize_t)(blen + 4)) { snprintf(err, errlen, "tcp send failed"); goto out; }
    if (read_all(fd, head, 4)) { snprintf(err, errlen, "no reply header"); goto out; }
    size_t rlen = (size_t)head[0] << 24 | (size_t)head[1] << 16 | (size_t)head[2] << 8 | head[3];
    if (rlen == 0 || rlen > 4096) { snprintf(err, errlen, "reply length %zu", rlen); goto out; }
    unsigned char rb[4096];
    json_t *rep = NULL;
    if (read_all(fd, rb, rlen) || tcp_decode("reply", rb, rlen, &rep, err, errlen)) goto out;
    long long st = json_integer_value(json_object_get(rep, "status"));
    long long rn = json_integer_value(json_object_get(rep, "nbytes"));
    long long rv = json_integer_value(json_object_get(rep, "v"));
    if (rv != 1 || st != 0 || rn != nbytes)
        snprintf(err, errlen, "reply v %lld status %lld nbytes %lld (%s)", rv, st, rn, jstr(rep, "detail", ""));
    json_decref(rep);
    if (rv != 1 || st != 0 || rn != nbytes) goto out;
    if (read_all(fd, buf, (size_t)nbytes)) { snprintf(err, errlen, "payload cut short"); goto out; }
    unsigned char extra;
    if (recv(fd, &extra, 1, MSG_PEEK | MSG_DONTWAIT) > 0) {
        snprintf(err, errlen, "bytes follow the payload");
        goto out;
    }
    rc = 0;
out:
    if (fd >= 0) close(fd);
    free(gb);
    json_decref(tg);
    return rc;
}

/* -- fetching ------------------------------------------------------------------------------------ */
typedef struct {
    const char *mm_hash;
    json_t *result;   /* set when final */
    int retry_status; /* last retryable status (NOT_READY/BUSY), 0 = none */
    int answered, parked;
    double due;
} item_t;

static const char *miss_of(int st) {
    switch (st) {
    case ST_MISSING: case ST_NOT_READY: return "MISSING";
    case ST_INCOMPAT: return "INCOMPATIBLE";
    case ST_VERSION: return "VERSION";
    case ST_BUSY: return "BUSY";
    default: return "INTERNAL";
    }
}

static json_t *miss(const char *reason, const char *detail) {
    char o[64];
    snprintf(o, sizeof o, "miss:%s", reason);
    return json_pack("{s:s,s:s}", "outcome", o, "detail", detail);
}

static json_t *landed(node_t *n, const unsigned char *b, size_t len) {
    unsigned char h[crypto_hash_sha256_BYTES];
    char hex[65];
    crypto_hash_sha256(h, b, len);
    to_hex(h, sizeof h, hex);
    n->landed_bytes += (long long)len;
    return json_pack("{s:s,s:s,s:I,s:s}", "outcome", "ok", "plane", "tcp", "nbytes",
                     (json_int_t)len, "sha256", hex);
}

/* one answer with a grant or inline data (status OK): the item's result; *done_ok is set to
 * 0/1 when a completion must be sent for the grant (-1: none) */
static json_t *take(node_t *n, session_t *s, json_t *grant, json_t *data, double t_req,
                    double deadline, int *done_ok) {
    *done_ok = -1;
    size_t dlen = 0;
    if (!grant || json_is_null(grant)) { /* inline (ectp-v2.md 4.2, 5.5): no window, no done */
        unsigned char *d = data ? json_hex(data, &dlen) : NULL;
        json_t *r;
        if (!d) r = miss("INTERNAL", "OK answer without a grant");
        else if (dlen % (size_t)n->block_bytes) r = miss("INCOMPATIBLE", "inline data is not whole rows");
        else r = landed(n, d, dlen);
        free(d);
        return r;
    }
    *done_ok = 0;
    long long eb = json_integer_value(json_object_get(grant, "entry_bytes"));
    long long nb = json_integer_value(json_object_get(grant, "num_blocks"));
    long long bb = json_integer_value(json_object_get(grant, "block_bytes"));
    double lease = json_number_value(json_object_get(grant, "lease_s"));
    if (bb != n->block_bytes || nb != (eb + bb - 1) / bb || strcmp(jstr(grant, "plane", ""), "tcp") ||
        !(lease > 0) || !isfinite(lease))
        return miss("INCOMPATIBLE", "grant does not match this consumer's layout or plane");
    if (n->region_bytes > 0 && eb > n->region_bytes) return miss("NO_SPACE", "entry larger than the region");
    double valid_until = t_req + lease - fmin(0.25, lease / 4); /* ectp-v1.md 8.4 */
    if (now_s() >= valid_until) return miss("TIMEOUT", "grant arrived after its validity window");
    unsigned char *buf = malloc((size_t)(eb ? eb : 1));
    char err[512];
    json_t *r;
    if (tcp_receive(s, grant, eb, nb * bb, buf, fmin(deadline, valid_until), err, sizeof err))
        r = miss("INTERNAL", err);
    else if (now_s() >= valid_until) r = miss("TIMEOUT", "transfer completed after the window");
    else { r = landed(n, buf, (size_t)eb); *done_ok = 1; }
    free(buf);
    return r;
}

static void send_dones(node_t *n, session_t *s, json_t *dones) {
    (void)n;
    size_t k = json_array_size(dones);
    if (k == 1 || (k && (s->version < 2 || !s->dones))) { /* XferDone, one per grant: v1, or a
        producer whose Welcome does not list "dones" (ectp-v2.md 4.4) */
        size_t i;
        json_t *d;
        json_array_foreach(dones, i, d) {
            json_object_set_new(d, "v", json_integer(s->version));
            json_object_set_new(d, "session_id", json_string(s->sid));
            send_frame(s, "done", d);
        }
    } else if (k) { /* DoneBatch, 64 items per frame */
        for (size_t i = 0; i < k; i += 64) {
            json_t *part = json_array();
            for (size_t j = i; j < k && j < i + 64; j++) json_array_append(part, json_array_get(dones, j));
            json_t *f = json_pack("{s:i,s:s,s:o}", "v", s->version, "session_id", s->sid, "items", part);
            send_frame(s, "dones", f);
            json_decref(f);
        }
    }
    json_array_clear(dones);
}

static void add_done(json_t *dones, const char *mm, json_t *grant, int ok) {
    if (ok < 0) return;
    json_array_append_new(dones, json_pack("{s:s,s:O,s:b}", "mm_hash", mm, "grant_id",
                                           json_object_get(grant, "grant_id"), "ok", ok));
}

/* v1: one XferReq per entry (ectp-v1.md 8.2) */
static void fetch_v1(node_t *n, session_t *s, item_t *it, double deadline, json_t *dones) {
    double backoff = 0.02;
    while (!it->result) {
        double t_req = now_s();
        json_t *req = json_pack("{s:i,s:s,s:s,s:s,s:s}", "v", s->version, "session_id", s->sid,
                                "mm_hash", it->mm_hash, "compat_hash", n->compat, "dest", "hex:");
        send_frame(s, "req", req);
        json_decref(req);
        const char *kind;
        json_t *f, *ack = NULL;
        while (!ack && recv_frame(n, s, fmin(deadline, t_req + ACK_TIMEOUT_S), &kind, &f) == 0) {
            if (!strcmp(kind, "ack") && !strcmp(jstr(f, "mm_hash", ""), it->mm_hash) &&
                !strcmp(jstr(f, "session_id", ""), s->sid)) ack = f;
            else json_decref(f); /* Nack or unsolicited: logged by nobody, answered never */
        }
        if (!ack) {
            it->result = s->failed ? miss(s->fail_miss, s->fail_detail) : miss("TIMEOUT", "no XferAck in time");
            return;
        }
        int st = (int)json_integer_value(json_object_get(ack, "status")), ok;
        if (st == ST_OK) {
            json_t *g = json_object_get(ack, "grant");
            it->result = take(n, s, json_is_null(g) ? NULL : g, NULL, t_req, deadline, &ok);
            add_done(dones, it->mm_hash, g, ok);
        } else if ((st == ST_NOT_READY || st == ST_BUSY) && now_s() + backoff < deadline) {
            sleep_s(backoff);
            backoff = fmin(backoff * 2, 0.5);
        } else {
            it->result = miss(miss_of(st), jstr(ack, "detail", ""));
        }
        json_decref(ack);
    }
}

/* v2: one ReqBatch for the items still open; answers and Parked frames (ectp-v2.md 4-6) */
static void batch_round(node_t *n, session_t *s, item_t *its, int k, double deadline, json_t *dones) {
    json_t *items = json_array();
    int open = 0;
    for (int i = 0; i < k; i++) {
        its[i].answered = its[i].parked = 0;
        if (its[i].result) continue;
        json_array_append_new(items, json_pack("{s:s,s:s}", "mm_hash", its[i].mm_hash, "dest", "hex:"));
        open++;
    }
    uint64_t bid;
    randombytes_buf(&bid, sizeof bid);
    bid &= 0x7FFFFFFFFFFFFFFFull;
    double t_sent = now_s(), wait = fmax(0.0, fmin(WAIT_S, deadline - t_sent));
    json_t *f = json_pack("{s:i,s:s,s:I,s:s,s:f,s:i,s:o}", "v", s->version, "session_id", s->sid,
                          "batch_id", (json_int_t)bid, "compat_hash", n->compat, "wait_s", wait,
                          "inline_max", INLINE_MAX, "items", items);
    send_frame(s, "reqs", f);
    json_decref(f);
    for (int i = 0; i < k; i++) its[i].due = fmin(deadline, t_sent + ACK_TIMEOUT_S);
    while (open) {
        double due = deadline;
        for (int i = 0; i < k; i++)
            if (!its[i].result && !its[i].answered && its[i].due < due) due = its[i].due;
        const char *kind;
        json_t *m;
        if (recv_frame(n, s, due, &kind, &m)) {
            if (s->failed) { /* a session-ending Nack: every open item misses with its reason */
                for (int i = 0; i < k; i++)
                    if (!its[i].result) its[i].result = miss(s->fail_miss, s->fail_detail);
                return;
            }
            for (int i = 0; i < k; i++)
                if (!its[i].result && !its[i].answered && its[i].due <= now_s()) {
                    its[i].result = miss("TIMEOUT", its[i].parked ? "parked item not answered in time"
                                                                   : "item neither answered nor parked in time");
                    open--;
                }
            continue;
        }
        int mine = !strcmp(jstr(m, "session_id", ""), s->sid) &&
                   json_integer_value(json_object_get(m, "batch_id")) == (json_int_t)bid;
        size_t j;
        json_t *x;
        if (mine && !strcmp(kind, "park")) {
            double pw = fmin(json_number_value(json_object_get(m, "wait_s")), wait);
            json_array_foreach(json_object_get(m, "items"), j, x)
                for (int i = 0; i < k; i++)
                    if (!its[i].result && !its[i].answered && !its[i].parked &&
                        !strcmp(its[i].mm_hash, json_string_value(x))) {
                        its[i].parked = 1;
                        its[i].due = fmin(deadline, t_sent + pw + ACK_TIMEOUT_S);
                    }
        } else if (mine && !strcmp(kind, "acks")) {
            json_array_foreach(json_object_get(m, "items"), j, x) {
                for (int i = 0; i < k; i++) {
                    item_t *it = &its[i];
                    if (it->result || it->answered || strcmp(it->mm_hash, jstr(x, "mm_hash", ""))) continue;
                    int st = (int)json_integer_value(json_object_get(x, "status")), ok;
                    it->answered = 1;
                    open--;
                    if (st == ST_OK) {
                        json_t *g = json_object_get(x, "grant");
                        it->result = take(n, s, json_is_null(g) ? NULL : g, json_object_get(x, "data"),
                                          t_sent, deadline, &ok);
                        add_done(dones, it->mm_hash, g, ok);
                    } else if (st == ST_NOT_READY || st == ST_BUSY) {
                        it->retry_status = st;
                    } else {
                        it->result = miss(miss_of(st), jstr(x, "detail", ""));
                    }
                    break;
                }
            }
        }
        json_decref(m);
    }
}

json_t *node_fetch(node_t *n, json_t *p, json_t *hashes, double timeout_s, int many) {
    double t0 = now_s(), deadline = t0 + timeout_s;
    int k = (int)json_array_size(hashes);
    item_t *its = calloc((size_t)k, sizeof *its);
    for (int i = 0; i < k; i++) its[i].mm_hash = json_string_value(json_array_get(hashes, i));
    n->fetches += k;
    session_t *s = session(n, p, deadline);
    json_t *dones = json_array();
    if (!s || s->failed) {
        for (int i = 0; i < k; i++)
            its[i].result = miss(s ? s->fail_miss : "INTERNAL", s ? s->fail_detail : "too many producers");
    } else if (s->version < 2) {
        for (int i = 0; i < k; i++) {
            if (s->failed) { its[i].result = miss(s->fail_miss, s->fail_detail); continue; }
            fetch_v1(n, s, &its[i], deadline, dones);
            send_dones(n, s, dones); /* before any later request (ectp-v2.md 4.4) */
        }
    } else {
        double backoff = 0.02;
        for (;;) {
            batch_round(n, s, its, k, deadline, dones);
            send_dones(n, s, dones);
            int open = 0;
            for (int i = 0; i < k; i++) open += !its[i].result;
            if (!open) break;
            if (now_s() + backoff >= deadline) {
                for (int i = 0; i < k; i++)
                    if (!its[i].result) its[i].result = miss(miss_of(its[i].retry_status), "not ready or busy until the deadline");
                break;
            }
            sleep_s(backoff);
            backoff = fmin(backoff * 2, 0.5);
        }
    }
    json_decref(dones);
    json_t *out;
    if (!many) {
        out = its[0].result;
    } else {
        json_t *items = json_array();
        const char *first_bad = NULL;
        for (int i = 0; i < k; i++) {
            json_object_set_new(its[i].result, "mm_hash", json_string(its[i].mm_hash));
            const char *o = jstr(its[i].result, "outcome", "");
            if (strcmp(o, "ok") && !first_bad) first_bad = o;
            json_array_append_new(items, its[i].result);
        }
        out = json_pack("{s:s,s:o,s:s}", "outcome", first_bad ? first_bad : "ok", "items", items,
                        "plane", "tcp");
        if (s && !s->failed) json_object_set_new(out, "version", json_integer(s->version));
    }
    json_object_set_new(out, "seconds", json_real(now_s() - t0));
    free(its);
    return out;
}
