"""Read a Kafka topic from its beginning (kafka-python) and count its events by
(granularity, reason, action) (scripts/bench-window.sh)."""
import sys, json
from kafka import KafkaConsumer
c = KafkaConsumer(sys.argv[2], bootstrap_servers=sys.argv[1], auto_offset_reset='earliest',
                  consumer_timeout_ms=15000, enable_auto_commit=False, group_id=None)
kinds = {}; n = 0
for m in c:
    n += 1
    try:
        e = json.loads(m.value)
        k = (e.get('granularity', '?'), e.get('reason', '?'), e.get('action', '?'))
    except Exception:
        k = ('unparsed', '')
    kinds[k] = kinds.get(k, 0) + 1
print(f"events on {sys.argv[2]}: {n}")
for k, v in sorted(kinds.items(), key=lambda x: -x[1])[:12]:
    print(f"  {k}: {v}")
