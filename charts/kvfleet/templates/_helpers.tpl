{{/* The release's full name, at most 63 characters. */}}
{{- define "kvfleet.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "kvfleet.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{/* Labels of everything the release creates, but its component. */}}
{{- define "kvfleet.releaseLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "kvfleet.labels" -}}
{{ include "kvfleet.releaseLabels" . }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "kvfleet.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "kvfleet.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "kvfleet.operatorImage" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "kvfleet.engineImage" -}}
{{- printf "%s:%s" .Values.engine.image.repository (default .Chart.AppVersion .Values.engine.image.tag) -}}
{{- end -}}

{{- define "kvfleet.engineCpuImage" -}}
{{- printf "%s:%s" .Values.engine.image.repository (default (printf "%s-cpu" .Chart.AppVersion) .Values.engine.image.cpuTag) -}}
{{- end -}}

{{- define "kvfleet.routerImage" -}}
{{- $repo := default .Values.image.repository .Values.router.image.repository -}}
{{- $tag := default (default .Chart.AppVersion .Values.image.tag) .Values.router.image.tag -}}
{{- printf "%s:%s" $repo $tag -}}
{{- end -}}

{{/* Peering is on with more than one operator replica. */}}
{{- define "kvfleet.peering" -}}
{{- if gt (int .Values.replicaCount) 1 }}true{{ end -}}
{{- end -}}

{{/* namespaceSelector of monitors: the watched namespaces, else all. */}}
{{- define "kvfleet.monitorNamespaces" -}}
{{- if .Values.watchNamespaces -}}
matchNames:
  {{- toYaml .Values.watchNamespaces | nindent 2 }}
{{- else -}}
any: true
{{- end -}}
{{- end -}}

{{/* The operator's rules but kopf's peering (kvfleet.operator.rbac._RULES). */}}
{{- define "kvfleet.operatorRules" -}}
- apiGroups: [kvfleet.dev]
  resources: [inferenceservices]
  verbs: [get, list, watch]
- apiGroups: [kvfleet.dev]
  resources: [inferenceservices/status]
  verbs: [patch]
- apiGroups: [kvfleet.dev]
  resources: [inferenceservices/finalizers]
  verbs: [update]
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, list, watch, create, patch]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [get, list, watch, create, patch]
- apiGroups: [""]
  resources: [services, serviceaccounts]
  verbs: [get, list, watch, create, patch]
- apiGroups: [""]
  resources: [configmaps]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [rbac.authorization.k8s.io]
  resources: [roles, rolebindings]
  verbs: [get, list, watch, create, patch]
- apiGroups: [""]
  resources: [pods]
  verbs: [list, watch, patch]
- apiGroups: [""]
  resources: [events]
  verbs: [create]
- apiGroups: [discovery.k8s.io]
  resources: [endpointslices]
  verbs: [get, list, watch]
{{- end -}}
