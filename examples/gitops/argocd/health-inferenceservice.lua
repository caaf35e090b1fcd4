-- Argo CD health check for kvfleet.dev InferenceService (docs/gitops.md).
-- It reads the conditions the operator writes (Ready, Progressing, Degraded, each with
-- observedGeneration) and never guesses from the children: the operator has already folded
-- their Deployments and pods into those conditions.
hs = {}

local generation = nil
if obj.metadata ~= nil then
  generation = obj.metadata.generation
end

if obj.status == nil or obj.status.conditions == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the kvfleet operator to report a status"
  return hs
end

-- A status written for an older generation describes the old spec: a fresh sync must not be
-- reported from it, whichever way it reads.
local observed = obj.status.observedGeneration
if generation ~= nil and (observed == nil or observed < generation) then
  hs.status = "Progressing"
  hs.message = "Waiting for the kvfleet operator to observe generation " .. tostring(generation)
  return hs
end

local conditions = {}
for _, condition in ipairs(obj.status.conditions) do
  if generation ~= nil and condition.observedGeneration ~= nil
      and condition.observedGeneration < generation then
    hs.status = "Progressing"
    hs.message = "Waiting for the kvfleet operator to observe generation " .. tostring(generation)
    return hs
  end
  if condition.type ~= nil then
    conditions[condition.type] = condition
  end
end

local function describe(condition)
  local text = condition.reason or ""
  if condition.message ~= nil and condition.message ~= "" then
    text = text .. ": " .. condition.message
  end
  return text
end

local ready = conditions["Ready"]
local progressing = conditions["Progressing"]
local degraded = conditions["Degraded"]

-- Degraded first: an invalid or refused spec leaves the previous children serving (Ready=True),
-- and the sync that brought it must not look healthy.
if degraded ~= nil and degraded.status == "True" then
  hs.status = "Degraded"
  hs.message = describe(degraded)
  return hs
end

if progressing ~= nil and progressing.status == "True" then
  hs.status = "Progressing"
  hs.message = describe(progressing)
  return hs
end

if ready ~= nil and ready.status == "True" then
  hs.status = "Healthy"
  hs.message = describe(ready)
  return hs
end

-- Scaled to zero by the autoscaler: nothing is wrong, the router holds the next request while
-- an engine starts.
if ready ~= nil and ready.reason == "ScaledToZero" then
  hs.status = "Healthy"
  hs.message = describe(ready)
  return hs
end

hs.status = "Progressing"
if ready ~= nil then
  hs.message = describe(ready)
else
  hs.message = "Waiting for the kvfleet operator to report the Ready condition"
end
return hs
