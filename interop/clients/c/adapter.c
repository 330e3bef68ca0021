/* ectp-client main: the adapter protocol (interop/ADAPTER.md, version 1) on stdin/stdout, and
 * the golden-vector check.
 *
 *   ectp-client adapter [--versions 1[,2]]    JSON lines (a consumer node; no producer role),
 *                                             speaking only the ECTP versions listed
 *   ectp-client vectors DIR [VERSION...]      check DIR/v<N>/index.json, one line per vector
 *   ectp-client compat MODEL DTYPE HIDDEN     print the compatibility hash
 *   ectp-client tcp-decode WHAT HEX           decode a tcp plane structure (frames: with length)
 */
#include "ectp.h"

#include <msgpack.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

#define MAX_NODES 32

static struct { char id[128]; node_t *node; } nodes[MAX_NODES];

/* -- golden vectors (protocols/README.md: decode to the fields, re-encode byte for byte,
 *    reject every invalid vector with its status) ------------------------------------------- */
static unsigned char *read_hex_file(const char *path, size_t *n) {
    FILE *f = fopen(path, "r");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long len = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *s = malloc((size_t)len + 5);
    memcpy(s, "hex:", 4);
    size_t got = fread(s + 4, 1, (size_t)len, f);
    fclose(f);
    while (got && (s[4 + got - 1] == '\n' || s[4 + got - 1] == '\r')) got--;
    s[4 + got] = 0;
    json_t *j = json_string(s);
    free(s);
    unsigned char *b = json_hex(j, n);
    json_decref(j);
    return b;
}

static int check_one(const char *dir, json_t *vec, int valid, int version, char *why, size_t wl) {
    char path[4096];
    size_t n;
    snprintf(path, sizeof path, "%s/%s", dir, json_string_value(json_object_get(vec, "file")));
    unsigned char *b = read_hex_file(path, &n);
    if (!b) return snprintf(why, wl, "cannot read %s", path), -1;
    const char *kind;
    json_t *got = NULL;
    int rc = -1;
    if (valid) {
        json_t *fields = json_object_get(vec, "fields");
        json_t *fv = json_object_get(fields, "v");
        int A[1] = {fv ? (int)json_integer_value(fv) : version};
        int st = ectp_decode(b, n, A, 1, &kind, &got, why, wl);
        unsigned char *re = NULL;
        size_t rn = 0;
        if (st != ST_OK) { /* why is set */ }
        else if (strcmp(kind, json_string_value(json_object_get(vec, "kind"))))
            snprintf(why, wl, "decoded as %s", kind);
        else if (!json_equal(got, fields)) {
            char *d = json_dumps(got, JSON_COMPACT | JSON_SORT_KEYS);
            snprintf(why, wl, "fields differ: %.300s", d);
            free(d);
        } else if (ectp_encode(kind, fields, &re, &rn, why, wl)) {
        } else if (rn != n || memcmp(re, b, n)) snprintf(why, wl, "re-encodes to other bytes");
        else rc = 0;
        free(re);
    } else {
        json_t *vs = json_object_get(vec, "versions"), *x;
        int A[16], nA = 0;
        size_t i;
        json_array_foreach(vs, i, x) if (nA < 16) A[nA++] = (int)json_integer_value(x);
        int want = (int)json_integer_value(json_object_get(vec, "status"));
        int st = ectp_decode(b, n, A, nA, &kind, &got, why, wl);
        if (st == ST_OK) snprintf(why, wl, "accepted");
        else if (st != want) {
            char reason[512];
            snprintf(reason, sizeof reason, "%s", why);
            snprintf(why, wl, "rejected with status %d, expected %d (%s)", st, want, reason);
        }
        else rc = 0;
    }
    json_decref(got);
    free(b);
    return rc;
}

json_t *check_vectors(const char *root, json_t *versions, int verbose) {
    int total = 0, passed = 1;
    char detail[2048] = "";
    size_t vi;
    json_t *vv;
    json_array_foreach(versions, vi, vv) {
        int version = (int)json_integer_value(vv), count = 0;
        char dir[4096], idx[4200], line[512];
        snprintf(dir, sizeof dir, "%s/v%d", root, version);
        snprintf(idx, sizeof idx, "%s/index.json", dir);
        json_error_t je;
        json_t *index = json_load_file(idx, 0, &je);
        if (!index) {
            passed = 0;
            snprintf(line, sizeof line, "%sno golden vectors for v%d", *detail ? "; " : "", version);
            strncat(detail, line, sizeof detail - strlen(detail) - 1);
            continue;
        }
        const char *lists[2] = {"valid", "invalid"};
        for (int valid = 1; valid >= 0; valid--) {
            size_t i;
            json_t *vec;
            json_array_foreach(json_object_get(index, lists[1 - valid]), i, vec) {
                char why[1024] = "";
                int ok = check_one(dir, vec, valid, version, why, sizeof why) == 0;
                const char *name = json_string_value(json_object_get(vec, "name"));
                if (verbose) printf("%s v%d %s%s %s\n", ok ? "PASS" : "FAIL", version,
                                    valid ? "" : "invalid/", name, why);
                if (!ok && passed) {
                    snprintf(line, sizeof line, "%sv%d %s: %s", *detail ? "; " : "", version, name, why);
                    strncat(detail, line, sizeof detail - strlen(detail) - 1);
                }
                passed &= ok;
                count++;
            }
        }
        total += count;
        if (passed) {
            snprintf(line, sizeof line, "%sv%d: %d vectors", *detail ? "; " : "", version, count);
            strncat(detail, line, sizeof detail - strlen(detail) - 1);
        }
        json_decref(index);
    }
    return json_pack("{s:s,s:b,s:s,s:i}", "outcome", "ok", "passed", passed, "detail", detail,
                     "vectors", total);
}

/* -- the adapter protocol --------------------------------------------------------------------- */
static json_t *err_out(const char *outcome, const char *detail) {
    return json_pack("{s:s,s:s}", "outcome", outcome, "detail", detail);
}

static int find(const char *id) {
    for (int i = 0; i < MAX_NODES; i++)
        if (nodes[i].node && !strcmp(nodes[i].id, id)) return i;
    return -1;
}

static json_t *producer_arg(json_t *cmd, const char **bad) {
    json_t *p = json_object_get(cmd, "producer");
    json_t *port = json_object_get(p, "port"), *key = json_object_get(p, "public_key");
    if (!json_is_object(p) || !json_is_string(json_object_get(p, "host")) || !json_is_integer(port) ||
        json_integer_value(port) <= 0 || json_integer_value(port) > 65535 ||
        (key && !json_is_null(key) && !json_is_string(key))) {
        *bad = "producer must be {host, port, public_key}";
        return NULL;
    }
    return p;
}

static json_t *handle(json_t *cmd) {
    const char *op = json_string_value(json_object_get(cmd, "op"));
    const char *id = json_string_value(json_object_get(cmd, "id"));
    json_t *t = json_object_get(cmd, "timeout_s");
    double timeout_s = json_is_number(t) ? json_number_value(t) : -1;
    const char *bad = NULL;
    if (!op) return err_out("error:BadRequest", "missing field 'op'");
    if (!strcmp(op, "exit")) return json_pack("{s:s,s:b}", "outcome", "ok", "bye", 1);
    char zv[32];
    int ma, mi, pa;
    zmq_version(&ma, &mi, &pa);
    snprintf(zv, sizeof zv, "%d.%d.%d", ma, mi, pa);
    if (!strcmp(op, "hello")) {
        json_t *vs = json_array();
        for (int v = 1; v <= 2; v++)
            if (ectp_version_mask >> v & 1) json_array_append_new(vs, json_integer(v));
        return json_pack("{s:s,s:i,s:{s:s,s:s},s:{s:s,s:s,s:s},s:[s],s:o,s:[s],s:[s,s,s,s,s,s]}",
                         "outcome", "ok", "adapter", 1, "impl", "name", "ectp-c", "version", "0.1",
                         "libs", "libzmq", zv, "msgpack-c", msgpack_version(),
                         "jansson", JANSSON_VERSION, "roles", "consumer", "versions", vs,
                         "planes", "tcp", "features", "curve", "fetch_many", "plain",
                         "trust_refusal", "vectors", "versions");
    }
    if (!strcmp(op, "vectors")) {
        json_t *vs = json_object_get(cmd, "versions");
        const char *root = json_string_value(json_object_get(cmd, "root"));
        if (!json_is_array(vs)) return err_out("error:BadRequest", "versions must be a list");
        if (!root) root = getenv("ECTP_VECTORS");
        if (!root) return err_out("error:BadRequest", "no vectors directory (root or $ECTP_VECTORS)");
        return check_vectors(root, vs, 0);
    }
    if (!strcmp(op, "start")) {
        json_t *d = json_object_get(cmd, "node");
        if (!id || !json_is_object(d) || !json_is_string(json_object_get(d, "role")) ||
            !json_is_string(json_object_get(d, "model")) ||
            !json_is_string(json_object_get(d, "dtype")) ||
            !json_is_integer(json_object_get(d, "hidden")) ||
            !json_is_array(json_object_get(d, "planes")))
            return err_out("error:BadRequest", "start needs id and node {role, model, dtype, hidden, planes}");
        if (find(id) >= 0) return err_out("error:BadRequest", "id in use");
        const char *role = json_string_value(json_object_get(d, "role"));
        if (strcmp(role, "producer") && strcmp(role, "consumer"))
            return err_out("error:BadRequest", "role must be producer or consumer");
        if (!strcmp(role, "producer")) return err_out("refused:Unsupported", "a consumer-only client");
        char err[256];
        node_t *n = node_new(d, err, sizeof err);
        if (!n) {
            char *bar = strchr(err, '|');
            *bar = 0;
            return err_out(err, bar + 1);
        }
        for (int i = 0; i < MAX_NODES; i++)
            if (!nodes[i].node) {
                snprintf(nodes[i].id, sizeof nodes[i].id, "%s", id);
                nodes[i].node = n;
                return json_pack("{s:s}", "outcome", "ok");
            }
        node_free(n);
        return err_out("error:BadRequest", "too many nodes");
    }
    if (!strcmp(op, "close")) {
        if (!id) return err_out("error:BadRequest", "missing field 'id'");
        int i = find(id);
        if (i >= 0) { node_free(nodes[i].node); nodes[i].node = NULL; }
        return json_pack("{s:s}", "outcome", "ok");
    }
    static const char *ops[] = {"put", "announce", "connect", "fetch", "fetch_many", "stats", NULL};
    int known = 0;
    for (int i = 0; ops[i]; i++) known |= !strcmp(ops[i], op);
    if (!known) return err_out("error:UnknownOp", op);
    if (!id) return err_out("error:BadRequest", "missing field 'id'");
    int i = find(id);
    if (i < 0) return err_out("error:UnknownNode", id);
    node_t *n = nodes[i].node;
    if (!strcmp(op, "stats")) return json_pack("{s:s,s:o}", "outcome", "ok", "stats", node_stats(n));
    if (!strcmp(op, "put") || !strcmp(op, "announce"))
        return err_out("error:BadRequest", "this node is a consumer");
    json_t *p = producer_arg(cmd, &bad);
    if (!p) return err_out("error:BadRequest", bad);
    if (timeout_s < 0 || timeout_s > 1e6) return err_out("error:BadRequest", "timeout_s must be a number >= 0");
    if (!strcmp(op, "connect")) return node_connect(n, p, timeout_s);
    if (!strcmp(op, "fetch")) {
        json_t *h = json_object_get(cmd, "mm_hash");
        if (!json_is_string(h)) return err_out("error:BadRequest", "missing field 'mm_hash'");
        json_t *one = json_pack("[O]", h), *r = node_fetch(n, p, one, timeout_s, 0);
        json_decref(one);
        return r;
    }
    json_t *hs = json_object_get(cmd, "mm_hashes"), *x;
    size_t j;
    int ok = json_is_array(hs) && json_array_size(hs) > 0 && json_array_size(hs) <= 64;
    json_array_foreach(hs, j, x) ok &= json_is_string(x);
    if (!ok) return err_out("error:BadRequest", "mm_hashes must be 1..64 strings");
    return node_fetch(n, p, hs, timeout_s, 1);
}

static int adapter(void) {
    char *line = NULL;
    size_t cap = 0;
    ssize_t len;
    int stop = 0;
    setvbuf(stdout, NULL, _IOLBF, 0);
    while (!stop && (len = getline(&line, &cap, stdin)) > 0) {
        if (strspn(line, " \t\r\n") == (size_t)len) continue;
        json_error_t je;
        json_t *cmd = json_loadb(line, (size_t)len, 0, &je), *res;
        if (!json_is_object(cmd)) {
            res = err_out("error:BadRequest", cmd ? "a request is a JSON object" : je.text);
            json_object_set_new(res, "seq", json_null());
        } else {
            const char *op = json_string_value(json_object_get(cmd, "op"));
            stop = op && !strcmp(op, "exit");
            res = handle(cmd);
            json_t *seq = json_object_get(cmd, "seq");
            json_object_set(res, "seq", seq ? seq : json_null());
        }
        char *out = json_dumps(res, JSON_COMPACT);
        printf("%s\n", out);
        free(out);
        json_decref(res);
        json_decref(cmd);
    }
    free(line);
    for (int i = 0; i < MAX_NODES; i++)
        if (nodes[i].node) node_free(nodes[i].node);
    return 0;
}

/* "1", "2" or "1,2" -> the bits of those versions; 0 for anything else */
static int version_mask(const char *arg) {
    int mask = 0;
    for (const char *c = arg; *c; c++) {
        if (*c == '1' || *c == '2') mask |= 1 << (*c - '0');
        else if (*c != ',') return 0;
    }
    return mask;
}

int main(int argc, char **argv) {
    if (sodium_init() < 0) return 2;
    if (argc >= 2 && !strcmp(argv[1], "adapter")) {
        if (argc == 4 && !strcmp(argv[2], "--versions")) {
            ectp_version_mask = version_mask(argv[3]);
            if (!ectp_version_mask) {
                fprintf(stderr, "--versions takes 1, 2 or 1,2, got %s\n", argv[3]);
                return 2;
            }
        } else if (argc != 2) {
            fprintf(stderr, "usage: %s adapter [--versions 1[,2]]\n", argv[0]);
            return 2;
        }
        return adapter();
    }
    if (argc >= 3 && !strcmp(argv[1], "vectors")) {
        json_t *vs = json_array();
        for (int i = 3; i < argc; i++) json_array_append_new(vs, json_integer(atoi(argv[i])));
        if (argc == 3) json_array_append_new(vs, json_integer(1)), json_array_append_new(vs, json_integer(2));
        json_t *r = check_vectors(argv[2], vs, 1);
        int ok = json_is_true(json_object_get(r, "passed"));
        printf("%s: %s\n", ok ? "passed" : "FAILED", json_string_value(json_object_get(r, "detail")));
        json_decref(r);
        json_decref(vs);
        return ok ? 0 : 1;
    }
    if (argc == 4 && !strcmp(argv[1], "tcp-decode")) { /* plane-tcp.md's examples */
        json_t *h = json_pack("s+", "hex:", argv[3]);
        size_t n;
        unsigned char *b = json_hex(h, &n);
        json_decref(h);
        size_t skip = !strcmp(argv[2], "request") || !strcmp(argv[2], "reply") ? 4 : 0;
        json_t *out = NULL;
        char err[256];
        if (!b || n < skip || tcp_decode(argv[2], b + skip, n - skip, &out, err, sizeof err)) {
            fprintf(stderr, "%s\n", b ? err : "not hex");
            free(b);
            return 1;
        }
        unsigned char *re;
        size_t rn;
        int same = tcp_encode(argv[2], out, &re, &rn, err, sizeof err) == 0 && rn == n - skip &&
                   !memcmp(re, b + skip, rn);
        char *d = json_dumps(out, JSON_COMPACT);
        printf("%s %s\n", same ? "re-encodes-equal" : "re-encodes-differently", d);
        free(d);
        free(b);
        json_decref(out);
        return 0;
    }
    if (argc == 5 && !strcmp(argv[1], "compat")) {
        char h[65];
        long long bb;
        if (compat_hash(argv[2], argv[3], atoll(argv[4]), h, &bb)) return 1;
        printf("%s\n", h);
        return 0;
    }
    fprintf(stderr, "usage: %s adapter [--versions 1[,2]] | vectors DIR [VERSION...] | compat MODEL DTYPE HIDDEN | "
                    "tcp-decode endpoint|grant|request|reply HEX\n", argv[0]);
    return 2;
}
