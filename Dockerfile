# walrelay: a static binary on a distroless base.
FROM golang:1.26 AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
ARG VERSION=docker
RUN CGO_ENABLED=0 go build -trimpath -ldflags "-s -w -X main.version=${VERSION}" -o /walrelay ./cmd/walrelay

FROM gcr.io/distroless/static-debian12:nonroot
COPY --from=build /walrelay /walrelay
EXPOSE 9187
ENTRYPOINT ["/walrelay"]
CMD ["run"]
