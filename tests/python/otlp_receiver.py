"""An OTLP/HTTP metrics (and logs) receiver for the tests, as a collector's otlphttp receiver takes them:
POST /v1/metrics with a protobuf ExportMetricsServiceRequest, decoded with OpenTelemetry's own
classes (opentelemetry-proto from PyPI). Each request is appended to OUT as one JSON line:
its resource attributes and every metric (name, unit, kind, temporality, monotonic, and each
point's attributes and value, or a histogram's count, sum, bounds and per-bucket counts).

usage: otlp_receiver.py OUT --port-file FILE [--port N] [--delay-file FILE] [--tls CERT KEY]

--delay-file: when FILE exists, each answer waits the seconds it holds (a slow collector).
--tls: serve https with this certificate and key (PEM).
"""

import argparse
import http.server
import json
import os
import sys
import time

from opentelemetry.proto.collector.logs.v1 import logs_service_pb2
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2


def value_of(any_value):
    return getattr(any_value, any_value.WhichOneof("value"))


def attrs(key_values):
    return {kv.key: value_of(kv.value) for kv in key_values}


def number(point):
    kind = point.WhichOneof("value")
    return point.as_double if kind == "as_double" else point.as_int


def metric_json(m):
    kind = m.WhichOneof("data")
    out = {"name": m.name, "unit": m.unit, "kind": kind, "description": m.description}
    data = getattr(m, kind)
    if kind in ("sum", "histogram"):
        out["temporality"] = data.aggregation_temporality
    if kind == "sum":
        out["monotonic"] = data.is_monotonic
    points = []
    for p in data.data_points:
        point = {"attrs": attrs(p.attributes), "start_ns": p.start_time_unix_nano, "ns": p.time_unix_nano}
        if kind == "histogram":
            point.update(count=p.count, sum=p.sum, bounds=list(p.explicit_bounds), buckets=list(p.bucket_counts))
        else:
            point["value"] = number(p)
        points.append(point)
    out["points"] = points
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--port-file", required=True)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--delay-file")
    ap.add_argument("--tls", nargs=2, metavar=("CERT", "KEY"))
    args = ap.parse_args()

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            if args.delay_file and os.path.exists(args.delay_file):
                try:
                    time.sleep(float(open(args.delay_file).read().strip() or "0"))
                except ValueError:
                    pass
            if self.path == "/v1/logs" and self.headers.get("Content-Type") == "application/x-protobuf":
                return self.logs(body)
            if self.path != "/v1/metrics" or self.headers.get("Content-Type") != "application/x-protobuf":
                self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            req = metrics_service_pb2.ExportMetricsServiceRequest()
            req.ParseFromString(body)
            for rm in req.resource_metrics:
                line = {
                    "received_ns": time.time_ns(),
                    "resource": attrs(rm.resource.attributes),
                    "scopes": [sm.scope.name for sm in rm.scope_metrics],
                    "metrics": [metric_json(m) for sm in rm.scope_metrics for m in sm.metrics],
                }
                with open(args.out, "a") as f:
                    f.write(json.dumps(line) + "\n")
            reply = metrics_service_pb2.ExportMetricsServiceResponse().SerializeToString()
            try:
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the sender gave up waiting: what a slow collector sees

        def logs(self, body):
            req = logs_service_pb2.ExportLogsServiceRequest()
            req.ParseFromString(body)
            for rl in req.resource_logs:
                line = {
                    "received_ns": time.time_ns(),
                    "resource": attrs(rl.resource.attributes),
                    "logs": [{
                        "time_unix_nano": r.time_unix_nano,
                        "severity_number": r.severity_number,
                        "severity_text": r.severity_text,
                        "event_name": r.event_name,
                        "body": value_of(r.body),
                        "attributes": attrs(r.attributes),
                    } for sl in rl.scope_logs for r in sl.log_records],
                }
                with open(args.out, "a") as f:
                    f.write(json.dumps(line) + "\n")
            reply = logs_service_pb2.ExportLogsServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, *a):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    if args.tls:
        import ssl

        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(*args.tls)
        server.socket = context.wrap_socket(server.socket, server_side=True)
    with open(args.port_file + ".tmp", "w") as f:
        f.write(str(server.server_address[1]))
    os.rename(args.port_file + ".tmp", args.port_file)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    sys.exit(0)


if __name__ == "__main__":
    main()
