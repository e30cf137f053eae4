-- POST /v1/fine_tuning/jobs: a LoRA job on the training file given as the first argument, each with
-- its own Idempotency-Key (second argument + thread + counter), at most one per `delay` ms per
-- connection (third argument; 0: as fast as answers come).
dofile(os.getenv("WRK_LUA_DIR") .. "/common.lua")

local counter, prefix, body, pause = 0, nil, nil, 0

function init(args)
   prefix = args[2] .. "-" .. tostring(thread_id or 0)
   pause = tonumber(args[3] or "0")
   body = string.format('{"model": "preset:tiny-llama", "training_file": "%s", "suffix": "mixed", '
                        .. '"metadata": {"bench": "mixed"}, "training": {"peft": {"method": "lora"}}}', args[1])
end

function request()
   counter = counter + 1
   local headers = {}
   for k, v in pairs(wrk.headers) do headers[k] = v end
   headers["Content-Type"] = "application/json"
   headers["Idempotency-Key"] = prefix .. "-" .. counter
   return wrk.format("POST", "/v1/fine_tuning/jobs", headers, body)
end

function delay()
   return pause
end
