"""Drive N completion requests of varied English at a server (scripts/bench-window.sh):
prompts of 30-80 words cut at random (seed 7) from /usr/share/common-licenses and package
copyright files, 32 greedy tokens each, CONCURRENCY at a time. Prints the counts."""
import json, os, random, re, sys, threading, urllib.request, glob
url = sys.argv[1]; n = int(sys.argv[2]); conc = int(sys.argv[3])
# varied English: windows of 30-80 words from the license texts and Debian package docs
texts = []
for f in sorted(glob.glob('/usr/share/common-licenses/*')):
    if os.path.isfile(f):
        texts.append(open(f, errors='ignore').read())
for f in sorted(glob.glob('/usr/share/doc/*/copyright'))[:200]:
    texts.append(open(f, errors='ignore').read())
words = [w for t in texts for w in re.split(r'\s+', t) if w]
rng = random.Random(7)
prompts = []
for i in range(n):
    k = rng.randint(30, 80); s = rng.randrange(0, len(words) - k)
    prompts.append(' '.join(words[s:s + k]))
lock = threading.Lock(); idx = [0]; done = [0]; failed = [0]; toks = [0]
def worker():
    while True:
        with lock:
            if idx[0] >= n: return
            i = idx[0]; idx[0] += 1
        body = json.dumps({"model": "smollm2-135m-instruct", "prompt": prompts[i], "max_tokens": 32,
                           "temperature": 0}).encode()
        req = urllib.request.Request(url + '/v1/completions', body, {'Content-Type': 'application/json'})
        try:
            r = json.load(urllib.request.urlopen(req, timeout=300))
            with lock:
                done[0] += 1; toks[0] += r.get('usage', {}).get('completion_tokens', 0)
        except Exception as e:
            with lock: failed[0] += 1
ts = [threading.Thread(target=worker) for _ in range(conc)]
[t.start() for t in ts]; [t.join() for t in ts]
print(f"requests {n}: ok {done[0]}, failed {failed[0]}, completion tokens {toks[0]}, distinct prompts {len(set(prompts))}")
